"""Measure chapter 08's pipeline schedules on the CPU: each stage's busy and idle time per step at m = 1, 2, 4, 8
micro-batches against the bubble formula, the activations each stage holds at its peak, and a timeline picture of
each schedule drawn from the measured events.

The chapter logs only its tokens/s. This tool records the rest from outside, with no measuring code in the chapter:
with --record (under torchrun) it loads the chapter's script and patches its pipeline stage, schedule, loss,
gradient clipping, memory read-out and metrics log to time each micro-batch's forward, loss and backward on every
stage and count the activations with saved-tensor hooks (PipelineRecorder); rank 0 writes every rank's figures to
pipeline.jsonl, beside metrics.jsonl, on each logging step. Without --record it runs itself that way for each
schedule and m, and reads those files.

    python 08-pipeline-parallel/measure_pipeline.py                  # the table for the README, and the picture
    python 08-pipeline-parallel/measure_pipeline.py --microbatches 4 --schedules 1f1b
    torchrun --standalone --nproc-per-node 2 08-pipeline-parallel/measure_pipeline.py \\
        --record 08-pipeline-parallel/train_llm.py --pp 2 -e recorded     # outputs/recorded/pipeline.jsonl

Run it on an otherwise idle machine with at least --pp cores: the stages of a pipeline compute at the same time,
and a stage that waits for a CPU core looks busy, not idle.
"""

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
from estimate_memory import pipeline_bubble  # noqa: E402  (one definition of the bubble for the table and the tool)
SCRIPT = Path(__file__).resolve().parent / "train_llm.py"
FIGURE = Path(__file__).resolve().parent / "pipeline-schedules.png"
# NOTE: chapter 08's zero-bubble schedules: each backward in two passes, which needs --pp-grad-reduce step.
SPLIT_BACKWARD = ("interleaved-zb", "zbv")
COLORS = {"forward": "#4c72b0", "loss": "#8172b2", "backward": "#dd8452", "weight": "#c44e52", "reduce": "#55a868"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb",
                                                           "zbv"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, cut into the micro-batches")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first two are not measured")
    parser.add_argument("--figure-microbatches", type=int, default=4, help="the m of the timeline picture")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' experiment folders (their pipeline.jsonl) here instead of deleting them")
    parser.add_argument("--record", nargs=argparse.REMAINDER, metavar="SCRIPT ARGS",
                        help="run SCRIPT (chapter 08's train_llm.py) with ARGS, recording pipeline.jsonl; the other "
                             "options are ignored")
    args = parser.parse_args()
    if args.record:
        record(Path(args.record[0]), args.record[1:])
        return

    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for schedule in args.schedules:
            for microbatches in args.microbatches:
                results[schedule, microbatches] = measure(schedule, microbatches, args, args.keep or Path(scratch))
    print_table(results, args.pp)
    if args.figure_microbatches in args.microbatches and not any(
            "error" in results[schedule, args.figure_microbatches] for schedule in args.schedules):
        draw_timelines({schedule: results[schedule, args.figure_microbatches]["timeline"]
                        for schedule in args.schedules}, args.figure_microbatches, args.figure)
        print(f"\nwrote {args.figure.relative_to(REPO) if args.figure.is_relative_to(REPO) else args.figure}")


def measure(schedule, microbatches, args, scratch):
    """Train args.steps steps with this schedule and return each pp rank's figures, averaged over the measured
    steps, and the timeline of the last step."""
    experiment = f"{schedule}-m{microbatches}"
    # NOTE: a folder left by an earlier measurement would be resumed from, not measured again.
    shutil.rmtree(scratch / experiment, ignore_errors=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.pp),
               __file__, "--record", str(SCRIPT), "--pp", str(args.pp), "--pp-schedule", schedule,
               "--pp-microbatches", str(microbatches),
               *(["--pp-grad-reduce", "step"] if schedule in SPLIT_BACKWARD else []),
               "--batch-size", str(args.batch_size), "--seq-length", str(args.seq_length),
               "--max-steps", str(args.steps), "--log-freq", "1", "--ckpt-freq", "1000", "--num-workers", "0",
               "--wandb-mode", "disabled", "--save-dir", str(scratch), "-e", experiment]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{schedule}, m = {microbatches} ...", file=sys.stderr, flush=True)
    result = subprocess.run(command, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        # NOTE: a layout the script refuses (1F1B with fewer micro-batches than stages) is a row of its own.
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        if not errors:
            raise RuntimeError(f"{experiment} failed:\n{result.stderr[-3000:]}")
        return {"error": errors[0]}
    records = [json.loads(line) for line in (scratch / experiment / "pipeline.jsonl").read_text().splitlines()]
    # NOTE: step 1 includes each stage's trial forward and backward (it learns the shapes it will send) and
    # step 2 the first optimizer steps' warm-up; the rest are steady.
    measured = records[2:]
    # NOTE: as PipelineRecorder.log() reckons it: the pipeline's step lasts as long as its longest rank's schedule.
    step_ms = sum(max(stats["pipeline_ms"] for stats in record["ranks"]) for record in measured) / len(measured)
    stages = {}
    for pp_rank in range(args.pp):
        per_step = [next(stats for stats in record["ranks"] if stats["pp_rank"] == pp_rank) for record in measured]
        busy = sum(stats["busy_ms"] for stats in per_step) / len(per_step)
        # NOTE: FSDP's gradient reduction after the last backward is neither the bubble nor the schedule's compute.
        reduce = sum(stats["reduce_ms"] for stats in per_step) / len(per_step)
        stages[pp_rank] = {"stages": per_step[-1]["stages"], "busy_ms": busy, "reduce_ms": reduce,
                           "idle_ms": step_ms - busy - reduce, "idle_fraction": 1 - (busy + reduce) / step_ms,
                           "peak_microbatches": per_step[-1]["peak_microbatches"],
                           "peak_activations_mb": per_step[-1]["peak_activations_mb"]}
    timeline = {pp_rank: next(stats for stats in records[-1]["ranks"] if stats["pp_rank"] == pp_rank)["events"]
                for pp_rank in range(args.pp)}
    return {"stages": stages, "timeline": timeline}


def bubble_formula(pp, microbatches, stages_per_rank, schedule):
    """The idle share of each stage in a balanced pipeline: tools/estimate_memory.py's pipeline_bubble(), which
    gives each schedule's formula."""
    return pipeline_bubble(pp, microbatches, stages_per_rank).get(schedule, 0.0)


def print_table(results, pp):
    print("| schedule | m | formula | " + " | ".join(
        f"rank {rank}: busy ms, idle ms, idle share" for rank in range(pp)) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in range(pp)) + " |")
    for (schedule, microbatches), result in results.items():
        if "error" in result:
            print(f"| {schedule} | {microbatches} | | {result['error'].split(';')[0]} |")
            continue
        stages_per_rank = len(result["stages"][0]["stages"])
        cells = [f"{stats['busy_ms']:.0f}, {stats['idle_ms']:.0f}, **{stats['idle_fraction']:.0%}**"
                 for stats in result["stages"].values()]
        print(f"| {schedule} | {microbatches} | {bubble_formula(pp, microbatches, stages_per_rank, schedule):.0%} | "
              + " | ".join(cells) + " |")
    print("\n| schedule | m | " + " | ".join(f"rank {rank}: micro-batches in flight, MB held" for rank in range(pp))
          + " |")
    print("| --- | --- | " + " | ".join("---" for _ in range(pp)) + " |")
    for (schedule, microbatches), result in results.items():
        if "error" in result:
            continue
        cells = [f"{stats['peak_microbatches']}, {stats['peak_activations_mb']:.1f}"
                 for stats in result["stages"].values()]
        print(f"| {schedule} | {microbatches} | " + " | ".join(cells) + " |")


def draw_timelines(timelines, microbatches, path):
    """One panel per schedule: a row per rank, a box per forward (with its loss) and backward, labeled with the
    micro-batch (and the stage, where a rank runs several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    figure, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.3 + 1.1 * len(timelines) * len(
        next(iter(timelines.values())))), squeeze=False)
    for axis, (schedule, timeline) in zip(axes[:, 0], timelines.items()):
        several_stages = any(len({stage for _, stage, *_ in events}) > 1 for events in timeline.values())
        for pp_rank, events in timeline.items():
            for kind, stage, microbatch, start, end in events:
                axis.broken_barh([(start, end - start)], (pp_rank - 0.4, 0.8), facecolors=COLORS[kind],
                                 edgecolors="white", linewidth=0.5)
                if kind in ("forward", "backward", "weight"):
                    label = f"{microbatch}" if not several_stages else f"{microbatch}\n(s{stage})"
                    axis.text((start + end) / 2, pp_rank, label, ha="center", va="center", fontsize=7, color="white")
        axis.set_yticks(list(timeline), [f"rank {rank}" for rank in timeline])
        axis.invert_yaxis()
        axis.set_title(f"{schedule}, {len(timeline)} ranks, {microbatches} micro-batches", fontsize=10, loc="left")
        axis.set_xlabel("ms since the rank entered the schedule")
    figure.legend(handles=[Patch(color=color, label=kind) for kind, color in COLORS.items()], loc="upper right",
                  ncols=3, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=80)


def record(script, script_args):
    """Run the script's main() with its stage, schedule, loss, gradient clipping, memory read-out and metrics log
    patched to record the pipeline."""
    spec = importlib.util.spec_from_file_location("train_llm", script)
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    recorder = PipelineRecorder()
    check_pipeline_layout, get_loss_function, log_metrics = (
        chapter.check_pipeline_layout, chapter.get_loss_function, chapter.log_metrics)
    build_pipeline_schedule, clip_grad_norm_across_stages, read_and_reset_memory_stats = (
        chapter.build_pipeline_schedule, chapter.clip_grad_norm_across_stages, chapter.read_and_reset_memory_stats)

    class RecordedPipelineStage(chapter.FSDPPipelineStage):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            with recorder.computation("forward", self.stage_index, fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with recorder.computation("backward", self.stage_index, bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

        def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
            with recorder.computation("weight", self.stage_index, bwd_chunk_id):
                return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

        def perform_reduce_grad(self, grad_scale_factor):
            with recorder.computation("reduce", self.stage_index, None):
                return super().perform_reduce_grad(grad_scale_factor)

    def recorded_schedule(*args, **kwargs):
        schedule, has_first_stage, has_last_stage = build_pipeline_schedule(*args, **kwargs)
        device = inspect.signature(build_pipeline_schedule).bind(*args, **kwargs).arguments["device"]
        step = schedule.step

        def recorded_step(*step_args, **step_kwargs):
            with recorder.pipeline(device):
                return step(*step_args, **step_kwargs)

        schedule.step = recorded_step
        return schedule, has_first_stage, has_last_stage

    def recorded_clipping(*args):
        recorder.step_ended = True  # NOTE: after the step's last schedule: the next one starts a new record
        return clip_grad_norm_across_stages(*args)

    def gathered_memory_stats(device):
        # NOTE: every rank reads its memory on logging steps, after the device finished the step (and before the
        # loop, with nothing recorded yet).
        if recorder.events:
            recorder.gather()
        return read_and_reset_memory_stats(device)

    def recorded_layout(args, config):
        recorder.args = args
        stages_per_rank, recorder.num_microbatches = check_pipeline_layout(args, config)
        return stages_per_rank, recorder.num_microbatches

    def log_metrics_and_pipeline(metrics_file, record):
        record["pipeline_idle_fraction"] = recorder.log(record["step"], Path(metrics_file.name).parent, chapter.LOGGER)
        log_metrics(metrics_file, record)

    chapter.FSDPPipelineStage, chapter.build_pipeline_schedule = RecordedPipelineStage, recorded_schedule
    chapter.clip_grad_norm_across_stages, chapter.read_and_reset_memory_stats = recorded_clipping, gathered_memory_stats
    chapter.check_pipeline_layout, chapter.log_metrics = recorded_layout, log_metrics_and_pipeline
    chapter.get_loss_function = lambda *args: recorder.timed_loss(get_loss_function(*args))
    sys.argv = [str(script), *script_args]
    chapter.main()


class Clock:
    """Spans of named work: CUDA events on a GPU, which time the kernels in the stream (the CPU's clock would time
    their queueing), the CPU's clock otherwise."""

    def __init__(self, device):
        import torch

        self.torch, self.use_cuda_events, self.spans = torch, device.type == "cuda", []

    @contextlib.contextmanager
    def __call__(self, name):
        start = self.now()
        yield
        self.spans.append((name, start, self.now()))

    def now(self):
        import time

        if not self.use_cuda_events:
            return time.perf_counter()
        event = self.torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def milliseconds(self, start, end):
        return start.elapsed_time(end) if self.use_cuda_events else (end - start) * 1000


class PipelineRecorder:
    """What this rank's stages compute in a step: when each micro-batch's forward, loss and backward ran and the step's
    last gradient reduction (reduce), and the activations each micro-batch keeps from its forward to its backward.

    NOTE: the time a rank spends in the schedule outside these computations, it waits (for a neighbour's activations or
    gradients, or the transfers): the pipeline's bubble, measured. The activations are the tensors autograd saves for
    the backward (saved-tensor hooks, as in chapter 05), each storage once, no weights. A micro-batch holds them from
    its forward until its backward, so how many a stage holds depends on the schedule (GPipe runs all forwards first).
    """

    def __init__(self):
        self.events, self.step_ended = [], True

    @contextlib.contextmanager
    def pipeline(self, device):
        """One schedule.step() (a step runs one per micro-step); the first after a step's end starts a new record."""
        if self.step_ended:
            self.start_step(device)
        with self.clock("pipeline"):
            yield

    def start_step(self, device):
        """Forget the last step's records and record this one."""
        self.clock, self.step_ended = Clock(device), False
        self.events = []
        self.saved_bytes = {}
        self.held_bytes = self.peak_bytes = self.peak_microbatches = 0

    @contextlib.contextmanager
    def computation(self, kind, stage_index, microbatch):
        import torch

        storages = {}

        def count_saved_tensor(tensor):
            base = tensor if tensor._base is None else tensor._base
            if not isinstance(base, torch.nn.Parameter):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with self.clock(kind):
            with torch.autograd.graph.saved_tensors_hooks(count_saved_tensor, lambda tensor: tensor):
                yield
        _, start, end = self.clock.spans[-1]
        self.events.append((kind, stage_index, microbatch, start, end))
        key = (stage_index, microbatch)
        # NOTE: zero bubble's input-gradient backward frees the micro-batch here; its weight part ("weight") keeps
        # some of those tensors until it runs, which this count leaves out.
        if kind == "backward":
            self.held_bytes -= self.saved_bytes.pop(key, 0)
        elif kind in ("forward", "loss"):
            self.saved_bytes[key] = self.saved_bytes.get(key, 0) + sum(storages.values())
            self.held_bytes += sum(storages.values())
            if self.held_bytes > self.peak_bytes:
                self.peak_bytes = self.held_bytes
                self.peak_microbatches = len({microbatch for _, microbatch in self.saved_bytes})

    def timed_loss(self, loss_function):
        """The loss function, recorded as part of the last stage's forward of each micro-batch.

        NOTE: the schedule calls it right after the last stage's forward of each micro-batch. The stage calls it
        once more on its own, before the first step: a trial forward and backward to learn the shapes it will send.
        """
        def recorded_loss_function(logits, labels):
            if not self.events or self.events[-1][0] != "forward":
                return loss_function(logits, labels)
            stage_index, microbatch = self.events[-1][1:3]
            with self.computation("loss", stage_index, microbatch):
                return loss_function(logits, labels)
        return recorded_loss_function

    def gather(self):
        """Every rank's figures of this step, kept on rank 0, in ms from its first schedule's start (a collective)."""
        import torch.distributed as dist

        if self.clock.use_cuda_events:
            self.clock.torch.cuda.synchronize()
        pipeline_spans = [(start, end) for name, start, end in self.clock.spans if name == "pipeline"]
        reference = pipeline_spans[0][0]

        def milliseconds(mark):
            return self.clock.milliseconds(reference, mark)

        events = [(kind, stage, microbatch, milliseconds(start), milliseconds(end))
                  for kind, stage, microbatch, start, end in self.events]
        # NOTE: the chapter's mesh is (pp, dp), pp first: rank = pp_rank x dp + dp_rank.
        rank, dp_size = dist.get_rank(), dist.get_world_size() // self.args.pp
        stats = {"rank": rank, "pp_rank": rank // dp_size, "dp_rank": rank % dp_size,
                 "stages": sorted({stage for _, stage, *_ in events}),
                 "pipeline_ms": sum(milliseconds(end) - milliseconds(start) for start, end in pipeline_spans),
                 "busy_ms": sum(end - start for kind, *_, start, end in events if kind != "reduce"),
                 "reduce_ms": sum(end - start for kind, *_, start, end in events if kind == "reduce"),
                 "peak_activations_mb": self.peak_bytes / 1e6,
                 "peak_microbatches": self.peak_microbatches, "events": events}
        self.all_stats = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(stats, self.all_stats, dst=0)

    def log(self, step, experiment_dir, logger):
        """On rank 0: log each stage's idle share of the step and its peak activations, append the step's timeline of
        every rank to pipeline.jsonl, and return the idle share averaged over the ranks of the first pipeline.

        NOTE: a stage's own time in the schedule is not the pipeline's: the last stage leaves once its last backward is
        done, and waits for the first stage's in the next collective (the gradient norm's). The pipeline's step lasts as
        long as its longest rank's schedule, the first stage's; each stage is idle for that minus its own computations.
        """
        first_pipeline = [stats for stats in self.all_stats if stats["dp_rank"] == 0]
        pipeline_ms = max(stats["pipeline_ms"] for stats in first_pipeline)
        idle_fractions = [1 - (stats["busy_ms"] + stats["reduce_ms"]) / pipeline_ms for stats in first_pipeline]
        logger.info(f"pipeline {self.args.pp_schedule}, {self.num_microbatches} micro-batches, {pipeline_ms:.0f} ms: "
                    + "; ".join(f"stages {stats['stages']} busy {stats['busy_ms']:.0f} ms, reduce "
                                f"{stats['reduce_ms']:.0f} ms, idle {idle * pipeline_ms:.0f} ms ({idle:.0%}), peak "
                                f"activations {stats['peak_activations_mb']:.1f} MB (micro-batches in flight: "
                                f"{stats['peak_microbatches']})" for stats, idle in zip(first_pipeline, idle_fractions)))
        with open(experiment_dir / "pipeline.jsonl", "a") as pipeline_file:
            pipeline_file.write(json.dumps({"step": step, "schedule": self.args.pp_schedule, "pp": self.args.pp,
                                            "microbatches": self.num_microbatches, "ranks": self.all_stats}) + "\n")
        return sum(idle_fractions) / len(idle_fractions)


if __name__ == "__main__":
    main()
