"""Measure chapter 08's pipeline schedules on the CPU: each stage's busy and idle time per step at m = 1, 2, 4, 8
micro-batches against the bubble formula, the activations each stage holds at its peak, and a timeline picture of
each schedule drawn from the measured events.

Every figure comes from the chapter's own records: the script times each micro-batch's forward, loss and backward on
every stage and counts the activations with saved-tensor hooks (PipelineRecorder), and rank 0 writes every rank's
figures to pipeline.jsonl on each logging step. This tool only runs the script and reads that file.

    python tools/measure_pipeline.py                  # the table for the README, and the picture
    python tools/measure_pipeline.py --microbatches 4 --schedules 1f1b

Run it on an otherwise idle machine with at least --pp cores: the stages of a pipeline compute at the same time,
and a stage that waits for a CPU core looks busy, not idle.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "08-pipeline-parallel" / "train_llm.py"
FIGURE = REPO / "08-pipeline-parallel" / "pipeline-schedules.png"
COLORS = {"forward": "#4c72b0", "loss": "#8172b2", "backward": "#dd8452", "reduce": "#55a868"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (processes)")
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved-1f1b"])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step, cut into the micro-batches")
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first two are not measured")
    parser.add_argument("--figure-microbatches", type=int, default=4, help="the m of the timeline picture")
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the runs' experiment folders (their pipeline.jsonl) here instead of deleting them")
    args = parser.parse_args()

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
               str(SCRIPT), "--pp", str(args.pp), "--pp-schedule", schedule, "--pp-microbatches", str(microbatches),
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
    # NOTE: as the script logs it: the pipeline's step lasts as long as its longest rank's schedule.
    step_ms = sum(max(stats["pipeline_ms"] for stats in record["ranks"]) for record in measured) / len(measured)
    stages = {}
    for pp_rank in range(args.pp):
        per_step = [next(stats for stats in record["ranks"] if stats["pp_rank"] == pp_rank) for record in measured]
        busy = sum(stats["busy_ms"] for stats in per_step) / len(per_step)
        # NOTE: FSDP's gradient reduction after the last backward is neither the bubble nor the schedule's compute.
        reduce = sum(stats["reduce_ms"] for stats in per_step) / len(per_step)
        stages[pp_rank] = {"stages": per_step[-1]["stages"], "busy_ms": busy, "reduce_ms": reduce,
                           "idle_ms": step_ms - busy - reduce, "idle_fraction": 1 - (busy + reduce) / step_ms, "peak_microbatches": per_step[-1]["peak_microbatches"],
                           "peak_activations_mb": per_step[-1]["peak_activations_mb"]}
    timeline = {pp_rank: next(stats for stats in records[-1]["ranks"] if stats["pp_rank"] == pp_rank)["events"]
                for pp_rank in range(args.pp)}
    return {"stages": stages, "timeline": timeline}


def bubble_formula(pp, microbatches, stages_per_rank):
    """The idle share of each stage in a balanced pipeline: (p - 1) / (v m + p - 1), v stages per rank."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def print_table(results, pp):
    print("| schedule | m | formula (p-1)/(vm+p-1) | " + " | ".join(
        f"rank {rank}: busy ms, idle ms, idle share" for rank in range(pp)) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in range(pp)) + " |")
    for (schedule, microbatches), result in results.items():
        if "error" in result:
            print(f"| {schedule} | {microbatches} | | {result['error'].split(';')[0]} |")
            continue
        stages_per_rank = len(result["stages"][0]["stages"])
        cells = [f"{stats['busy_ms']:.0f}, {stats['idle_ms']:.0f}, **{stats['idle_fraction']:.0%}**"
                 for stats in result["stages"].values()]
        print(f"| {schedule} | {microbatches} | {bubble_formula(pp, microbatches, stages_per_rank):.0%} | "
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
                if kind in ("forward", "backward"):
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


if __name__ == "__main__":
    main()
