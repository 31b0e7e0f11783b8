"""Dry-run one rank of a real-sized job on one CPU, with the chapter's own code, before renting the cluster.

    python tools/dry_run.py 04 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-8b
    python tools/dry_run.py 07 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-8b --tp 8
    python tools/dry_run.py 08 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-70b --pp 8
    python tools/dry_run.py 09 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-8b --cp 8 --seq-length 8192
    python tools/dry_run.py 11 --nnodes 4 --nproc-per-node 8 -m data/configs/llama-3.1-70b --tp 8 --pp 2 \\
        --seq-length 2048 --batch-size 4

Everything after the chapter goes to the chapter's train_llm.py, whose main() runs as on rank --rank of a job of
--nnodes x --nproc-per-node processes, with three things swapped underneath it:

* the process group is PyTorch's fake backend (FakeStore, init_process_group("fake")): every collective returns at
  once and no other rank exists (torchtitan's memory estimation does the same);
* every tensor is a FakeTensor (FakeTensorMode): shapes, dtypes and devices without memory or arithmetic, so a
  step of an 8B layer takes milliseconds and the weights are never initialized (init_weights is skipped);
* the data set is a batch of token ids of the right shape (no tokenizer or corpus is read), wandb is off, and no
  checkpoint is read or written.

The chapter builds its model on the meta device and shards it (fully_shard, its TP plan, its pipeline split, its
context-parallel wrapping) as on the cluster, and checks its input as there: a layout it rejects ends the dry run
with the chapter's own one-line `error:`. Two training steps run; PyTorch's memory tracker (FSDPMemTracker for a
model the chapter fully_shard()s, MemTracker otherwise) counts this rank's memory by category: what it holds after
the first optimizer step (parameters, gradients, optimizer state) and everything alive at the second step's peak.
Beside them: tools/estimate_memory.py's prediction for the same layout.

On the CPU the chapters compute in float32 unless told; a dry run is for a GPU job, so it passes --dtype bfloat16
unless the arguments give a --dtype. Limits: a fake collective moves nothing, so values (losses, gradient norms)
mean nothing; a pipeline stage cannot learn its neighbours' shapes, so the tool answers the shape exchange (for
every stage of chapters 08 and 11, two stages on one rank too); with --compile the layers run eager (dynamo
compiles nothing under the tracker's dispatch mode); peaks are sums of tensor sizes (no allocator
rounding or fragmentation, no CUDA/NCCL workspace); --cpu-offload needs CUDA, which the dry run does not fake. The
tracker's activations are those alive at the peak, the estimator's all that forward saves: compare the peaks.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

CHAPTERS = {path.name[:2]: path for path in sorted(REPO_ROOT.glob("[01][0-9]-*")) if (path / "train_llm.py").is_file()}
# NOTE: 01-03 build real weights and run DDP's reducer, which the fake process group cannot; their estimate suffices.
BUILT_ON_META = {number: path for number, path in CHAPTERS.items() if number >= "04"}
MB = 1e6


class DryRunDone(Exception):
    """Raised by the optimizer hook after the second step: the dry run has what it came for."""


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s CHAPTER --nnodes N "
                                     "--nproc-per-node G [--rank R] [--json] [CHAPTER'S ARGUMENTS ...]")
    parser.add_argument("chapter", type=chapter_number, help="the chapter: its number (04) or its folder "
                        "(04-fully-sharded-data-parallel/)")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0, help="the rank to run (default 0)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args, chapter_args = parser.parse_known_args()
    world_size = args.nnodes * args.nproc_per_node
    if not 0 <= args.rank < world_size:
        raise SystemExit(f"error: --rank {args.rank} is not in a job of {world_size} ranks; give 0 to {world_size - 1}")
    if not any(arg == "--dtype" or arg.startswith("--dtype=") for arg in chapter_args):
        chapter_args = [*chapter_args, "--dtype", "bfloat16"]
    started, cpu_started = time.perf_counter(), time.process_time()
    # NOTE: with --json, stdout holds the JSON alone (for jq): the chapter's log lines go to stderr.
    with contextlib.redirect_stdout(sys.stderr if args.json else sys.stdout):
        result = dry_run(args.chapter, chapter_args, args.rank, args.nproc_per_node, world_size)
    result["seconds"], result["cpu_seconds"] = time.perf_counter() - started, time.process_time() - cpu_started
    result["estimate"] = estimate(args.chapter, chapter_args, args.rank, args.nproc_per_node, world_size)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


def chapter_number(name):
    """A chapter's number from what a reader types: 04, 04-fully-sharded-data-parallel or its folder with a slash."""
    number = Path(name).name[:2]
    if number not in CHAPTERS or Path(name).name not in (number, CHAPTERS[number].name):
        raise argparse.ArgumentTypeError(f"{name!r} is not a chapter; give one of {', '.join(sorted(BUILT_ON_META))}")
    if number not in BUILT_ON_META:
        raise argparse.ArgumentTypeError(f"chapter {number} holds its whole model on every rank: its peak is "
                                         f"tools/estimate_memory.py's (--dp N, --zero1); dry-run 04 and later")
    return number


def load_chapter(chapter):
    script = CHAPTERS[chapter] / "train_llm.py"
    spec = importlib.util.spec_from_file_location(f"train_llm_{chapter}", script)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(script.parent))
    spec.loader.exec_module(module)
    return module


def dry_run(chapter, chapter_args, rank, nproc_per_node, world_size):
    """Run the chapter's main() for one rank under the fake backend and FakeTensorMode; its memory by category."""
    import tempfile
    import types

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed._tools import mod_tracker
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (InferenceMode, _derive_grad_metas, _StageBackwardMeta,
                                                   _StageForwardMeta, extract_tensor_meta)
    from torch.distributed.tensor import _sharding_prop
    from torch.testing._internal.distributed.fake_pg import FakeStore

    module = load_chapter(chapter)
    if "--compile" in chapter_args:
        # NOTE: dynamo compiles nothing under the memory tracker's dispatch mode (fullgraph=True then fails); the
        # chapter still checks the flag against the rest of its arguments.
        module.compile_layers = lambda model: None
        print("note: the dry run runs eager, without --compile: dynamo does not compile under its memory tracker",
              file=sys.stderr)
    found = {"optimizers": []}
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def init_process_group(*_, **__):
        dist.init_process_group.__wrapped__("fake", store=FakeStore(), rank=rank, world_size=world_size)

    init_process_group.__wrapped__ = dist.init_process_group

    def init_weights(model, seed):
        found["model"] = model

    def load_and_tokenize_dataset(args, tokenizer):
        found["args"] = args
        rows = range(args.batch_size * args.grad_accum * world_size * 2)
        # NOTE: chapter 05 returns its train rows, its eval rows and a summary.
        return (rows, None, "fake rows") if chapter == "05" else rows

    def get_dataloader(dataset, args, epoch, samples_seen_in_epoch, device, rank, world_size):
        batches = [{"input_ids": torch.randint(0, found["model"].config.vocab_size, (args.batch_size, args.seq_length),
                                               device=device)} for _ in range(2 * args.grad_accum)]
        start_tracker()
        return batches

    original_to_empty = torch.nn.Module.to_empty

    def to_empty(self, *a, **k):
        # NOTE: tensors turn fake from the first to_empty() on: device meshes (built before it) read their rank map
        # on the host, which a FakeTensor cannot give.
        if not found.get("fake"):
            found["fake"] = True
            found["exit"].enter_context(fake_mode)
        return original_to_empty(self, *a, **k)

    class RecordedAdamW(torch.optim.AdamW):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            found["optimizers"].append(self)
            self.register_step_post_hook(after_step)

    def update_peak(tracker, _state):
        # NOTE: the trackers' own version also updates every module's peak at every operator (the dry run's main
        # cost at 70B); only the totals are read here.
        for device, device_snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < device_snapshot["Total"]:
                tracker._peak_mem[device] = device_snapshot["Total"]
                tracker._peak_mem_snap[device] = dict(device_snapshot)

    class MicroBatchMemTracker(MemTracker):
        _update_peak_stats = update_peak

        def _pre_fw_hook(self, module, inputs):
            # NOTE: MemTracker refuses a root module's second forward in a step (a pipeline stage's next micro-batch,
            # gradient accumulation); its per-module statistics start again, the totals the dry run reads do not.
            if module in self.memory_tracking and not self._mod_tracker.is_bw and set(
                    self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                del self.memory_tracking[module]
            super()._pre_fw_hook(module, inputs)

    def start_tracker():
        model, optimizers = found["model"], found["optimizers"]
        if isinstance(model, FSDPModule) and len(optimizers) == 1:
            tracker = FSDPMemTracker(model, optimizers[0])
            tracker._update_peak_stats = types.MethodType(update_peak, tracker)
        else:
            tracker = MicroBatchMemTracker()
            tracker.track_external(model, *optimizers)
        found["tracker"] = tracker
        found["exit"].enter_context(tracker)

    def after_step(optimizer, *_):
        tracker = found["tracker"]
        optimizer.steps_done = getattr(optimizer, "steps_done", 0) + 1
        if any(getattr(o, "steps_done", 0) < optimizer.steps_done for o in found["optimizers"]):
            return
        if optimizer.steps_done == 1:
            found["held"] = snapshot(tracker.get_tracker_snapshot())
            # NOTE: the tracker counts AdamW's 0-dimensional step counters; the chapters' log, measure_step.py and
            # the estimator leave them out (4 bytes a parameter tensor), so they are given apart.
            found["step_counters"] = sum(value.numel() * value.element_size() for o in found["optimizers"]
                                         for state in o.state.values() for value in state.values()
                                         if torch.is_tensor(value) and value.dim() == 0)
            # NOTE: the first step has no optimizer state in its forward and backward; the peak that repeats is the
            # second step's, so the tracker's peak starts again here (as MemTracker.__enter__ sets it).
            tracker.reset_mod_stats()
            tracker._peak_mem_snap = tracker.get_tracker_snapshot()
            tracker._peak_mem = {device: snap["Total"] for device, snap in tracker._peak_mem_snap.items()}
        else:
            found["peak"] = snapshot(tracker.get_tracker_snapshot("peak"))
            raise DryRunDone

    # NOTE: a fake process group cannot carry the stages' shape exchange (a vote, then pickled metadata): every stage
    # votes alike, stage s+1 sends back the gradients' metadata of what stage s sent it, and stage s gets from s-1 a
    # micro-batch of hidden states in the compute dtype (FSDP's param_dtype), its tokens (over cp) split over tp in 11.
    sent_metas = {}

    def hidden_states_meta(stage):
        args = found["args"]
        micro_batch = args.batch_size // (args.pp_microbatches or args.batch_size)
        dtype = stage.submod._get_fsdp_state()._mp_policy.param_dtype or torch.float32
        tokens = stage.submod.position_ids.shape[-1] // found.get("tp_degree", 1)
        return extract_tensor_meta(torch.empty(micro_batch, tokens, found["model"].config.hidden_size, dtype=dtype,
                                               device="meta", requires_grad=True))

    def warmup_forward_vote(stage, has_backward, received_acc=None):
        stage.dry_run_vote = 0 if InferenceMode.needs_dynamic(stage._user_meta, has_backward) else 1
        return received_acc

    def warmup_backward_result(stage, received_result=None):
        return types.SimpleNamespace(item=lambda: stage.dry_run_vote)  # NOTE: the vote's only use: .item()

    def send_meta(stage, meta, dst_stage):
        sent_metas[stage.stage_index, dst_stage] = meta

    def recv_meta(stage, src_stage):
        if src_stage > stage.stage_index:
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(
                sent_metas[stage.stage_index, src_stage].forward_metas))
        return _StageForwardMeta(forward_metas=(hidden_states_meta(stage),))

    def untracked_backward(metadata_inference):
        # NOTE: a stage's shape inference (its own forward and backward) runs without the tracker's backward hooks:
        # they kept the first stage's forward alive (token ids take no gradient), and autograd.grad refuses them.
        def run(*args, **kwargs):
            with patched(mod_tracker, "register_multi_grad_hook", lambda *_, **__: None):
                return metadata_inference(*args, **kwargs)
        return run

    def leaf_safe_grad_hook(tensors, fn, mode="all"):
        # NOTE: zero bubble's input backward is an autograd.grad() over the stage's received hidden states, a leaf, on
        # which the tracker's multi-grad hook fails; the leaf's own tensor hook fires there (one tensor: the same call).
        if len(tensors) == 1 and tensors[0].grad_fn is None:
            return tensors[0].register_hook(fn)
        return register_multi_grad_hook(tensors, fn, mode=mode)

    def balanced_experts(experts, hidden_states, top_k_index, top_k_weights, ep_group):
        # NOTE: a fake tensor has no values for the host to read: chapter 10's split sizes are answered as balanced
        # routing gives them, each rank's (token, expert) pairs dealt evenly over the ep ranks, and as many received.
        pairs, ep_degree = top_k_index.numel(), dist.get_world_size(ep_group)
        found["split_sizes"] = [[pairs // ep_degree + (r < pairs % ep_degree) for r in range(ep_degree)]] * 2
        return expert_parallel_experts(experts, hidden_states, top_k_index, top_k_weights, ep_group)

    def tolist(tensor):
        if "split_sizes" in found:
            return found.pop("split_sizes")
        return original_tolist(tensor)

    def recorded_device_mesh(device, world_size, tp_degree, *degrees):
        # NOTE: chapter 11's tensor-parallel degree as it chose it (--tp defaults to the node's GPUs).
        found["tp_degree"] = tp_degree
        return device_mesh(device, world_size, tp_degree, *degrees)

    expert_parallel_experts, original_tolist = getattr(module, "expert_parallel_experts", None), FakeTensor.tolist
    register_multi_grad_hook = mod_tracker.register_multi_grad_hook
    device_mesh = getattr(module, "get_device_mesh", None)
    patches = dict(
        get_distributed_environment=lambda timeout: ("dry run", rank, rank % nproc_per_node, world_size),
        rank_zero_first=contextlib.nullcontext, init_weights=init_weights,
        AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda name: None),
        load_and_tokenize_dataset=load_and_tokenize_dataset, get_dataloader=get_dataloader,
        find_latest_checkpoint_on_rank_zero=lambda experiment_dir: None,
        expert_parallel_experts=balanced_experts,
        # NOTE: the model's constructor allocates each parameter on the host before it moves to meta (its buffers
        # keep their values): DeepSeek-V3's 30 GB of experts per layer. A dry run needs no buffer's value.
        parameters_on_meta=lambda: torch.device("meta"),
    )
    if chapter == "11":
        patches["get_device_mesh"] = recorded_device_mesh
    for name, value in patches.items():
        if hasattr(module, name):
            setattr(module, name, value)
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT="0", WANDB_MODE="disabled")
    with tempfile.TemporaryDirectory() as save_dir, contextlib.ExitStack() as exit_stack:
        found["exit"] = exit_stack
        sys.argv = [str(CHAPTERS[chapter] / "train_llm.py"), *chapter_args, "--save-dir", save_dir, "--max-steps",
                    "10", "--log-freq", "1000", "--ckpt-freq", "1000", "--num-workers", "0"]
        exit_stack.enter_context(patched(dist, "init_process_group", init_process_group))
        # NOTE: the fake backend is the only one here: the checkpoints' gloo group becomes a fake group too.
        new_group = dist.new_group
        exit_stack.enter_context(patched(dist, "new_group", lambda *args, backend=None, **kwargs: new_group(*args,
                                                                                                          **kwargs)))
        exit_stack.enter_context(patched(torch.optim, "AdamW", RecordedAdamW))
        exit_stack.enter_context(patched(module.wandb, "init", lambda *a, **k: None))
        exit_stack.enter_context(patched(module.wandb, "finish", lambda *a, **k: None))
        exit_stack.enter_context(patched(torch.nn.Module, "to_empty", to_empty))
        exit_stack.enter_context(patched(FakeTensor, "tolist", tolist))
        exit_stack.enter_context(patched(mod_tracker, "register_multi_grad_hook", leaf_safe_grad_hook))
        for name, value in [("_warmup_forward_vote", warmup_forward_vote), ("_send_meta", send_meta),
                            ("_warmup_backward_result", warmup_backward_result), ("_recv_meta", recv_meta)]:
            exit_stack.enter_context(patched(PipelineStage, name, value))
        for name in ["_forward_metadata_inference", "_backward_metadata_inference"]:
            exit_stack.enter_context(patched(PipelineStage, name, untracked_backward(getattr(PipelineStage, name))))
        # NOTE: DTensor derives an operator's output shape by running it on fake tensors of the global shape, in the
        # active fake mode; in another fake mode the tracker leaves them out (real runs never allocate them).
        propagation_mode = FakeTensorMode(allow_non_fake_inputs=True)
        exit_stack.enter_context(patched(_sharding_prop, "detect_fake_mode", lambda *_: propagation_mode))
        try:
            module.main()
        except DryRunDone:
            pass
        finally:
            exit_stack.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    if "peak" not in found:
        raise SystemExit("error: the chapter's main() returned before its second optimizer step")
    args = found["args"]
    return {"chapter": CHAPTERS[chapter].name, "rank": rank, "world_size": world_size,
            "tracker": type(found["tracker"]).__name__, "batch_size": args.batch_size, "seq_length": args.seq_length,
            "held": found["held"], "peak": found["peak"],
            "step_counter_bytes": found["step_counters"]}


@contextlib.contextmanager
def patched(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def snapshot(tracker_snapshot):
    """{category: bytes} summed over devices, from a tracker snapshot {device: {category: bytes, "Total": bytes}}."""
    total = {}
    for device_snapshot in tracker_snapshot.values():
        for category, value in device_snapshot.items():
            name = getattr(category, "value", category)
            total[name] = total.get(name, 0) + value
    return {category: value for category, value in total.items() if value}


def estimate(chapter, chapter_args, rank, nproc_per_node, world_size):
    """tools/estimate_memory.py's prediction for the layout the chapter's arguments describe."""
    import estimate_memory

    parser = argparse.ArgumentParser(add_help=False)
    default_model = "data/tiny-qwen3-moe" if chapter == "10" else "data/tiny-llama"
    for flag, default in [("-m", default_model), ("--tp", 1), ("--pp", 1), ("--cp", 1), ("--ep", 1),
                          ("--batch-size", 8), ("--seq-length", 256), ("--grad-accum", 1), ("--dtype", "bfloat16"),
                          ("--dp-replicate", 1)]:
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--pp-microbatches", type=int)
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--pp-grad-reduce", default="microbatch")
    parser.add_argument("--pp-schedule", default="1f1b")
    parser.add_argument("--pp-stages-per-rank", type=int, default=2)
    for flag in ["--activation-checkpointing", "--cpu-offload", "--split-root-group"]:
        parser.add_argument(flag, action="store_true")
    known, _ = parser.parse_known_args(chapter_args)
    if chapter == "06":
        known.tp = world_size
    model_parallel = known.tp * known.pp * known.cp
    if known.global_batch_size:
        known.grad_accum = known.global_batch_size // (known.batch_size * (world_size // model_parallel))
    if chapter in ("08", "11"):
        # NOTE: the estimator's --batch-size is one micro-batch and --grad-accum the micro-batches a stage runs in
        # a step: the batch's, times the accumulation steps (one schedule run a step).
        micro_batches = known.pp_microbatches or known.batch_size
        known.batch_size, known.grad_accum = known.batch_size // micro_batches, micro_batches * known.grad_accum
    argv = ["-m", known.m, "--dp", str(world_size // model_parallel), "--fsdp", "--rank", str(rank), "--batch-size",
            str(known.batch_size), "--seq-length", str(known.seq_length), "--grad-accum", str(known.grad_accum),
            "--dtype", known.dtype, "--pp-grad-reduce", known.pp_grad_reduce, "--json"]
    for flag in ["tp", "pp", "cp", "dp_replicate"]:
        if getattr(known, flag) > 1:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(known, flag))]
    for flag in ["activation_checkpointing", "cpu_offload", "split_root_group"]:
        if getattr(known, flag):
            argv.append(f"--{flag.replace('_', '-')}")
    # NOTE: the estimator models GPipe, 1F1B, interleaved 1F1B and ZBV; interleaved zero bubble is estimated as 1F1B.
    if known.pp_schedule in estimate_memory.IN_FLIGHT:
        argv += ["--pp-schedule", known.pp_schedule, "--pp-stages-per-rank", str(known.pp_stages_per_rank)]
    if chapter == "10":
        argv += ["--ep", str(known.ep)]
    if chapter == "06":
        argv.remove("--fsdp")
    if chapter == "05":
        argv.append("--split-root-group")
    argv[argv.index("-m") + 1] = str((REPO_ROOT / known.m) if not Path(known.m).is_absolute() else known.m)
    sys_argv, sys.argv = sys.argv, ["estimate_memory.py", *argv]
    try:
        args = estimate_memory.parse_args()
    finally:
        sys.argv = sys_argv
    return estimate_memory.estimate_step(estimate_memory.load_config(args.model_name),
                                         estimate_memory.layout_from_args(args))


def compare(result):
    """[(row, dry run bytes, estimate bytes)]: what both count, by the estimator's categories."""
    held, peak, est = result["held"], result["peak"], result["estimate"]

    def get(snap, *names):
        return sum(snap.get(name, 0) for name in names)

    params = ("Sharded Param", "Parameter")
    grads = ("Sharded Grad", "Gradient")
    counters = result["step_counter_bytes"]
    # NOTE: the held parameters: MemTracker files FSDP's gathered (unsharded) parameters as parameters too.
    dry_peak_other = peak["Total"] - get(held, *params) - get(peak, "Optstate", "OptState", "Activation")
    est_other = est["peak_bytes"] - est["params_bytes"] - est["optimizer_bytes"] - est["activations_at_peak_bytes"]
    return [("parameters", get(held, *params), est["params_bytes"]),
            ("gradients", get(held, *grads), est["grads_bytes"]),
            ("optimizer state", get(held, "Optstate", "OptState") - counters, est["optimizer_bytes"]),
            ("activations at the peak", get(peak, "Activation"), est["activations_at_peak_bytes"]),
            ("the rest at the peak", dry_peak_other, est_other),
            ("peak", peak["Total"], est["peak_bytes"])]


def print_table(result):
    print(f"dry run of {result['chapter']}, rank {result['rank']} of {result['world_size']}, batch size "
          f"{result['batch_size']} x {result['seq_length']} tokens: {result['seconds']:.0f} s, "
          f"{result['cpu_seconds']:.0f} s of CPU (fake process group, "
          f"fake tensors, {result['tracker']})")
    print(f"  {'MB on this rank':28s} {'dry run':>10s} {'estimate':>10s}")
    for row, dry, est in compare(result):
        print(f"  {row:28s} {dry / MB:10.1f} {est / MB:10.1f}" + (f"  {dry / est - 1:+.0%}" if est else ""))
    print(f"  the tracker's categories at the peak: " + ", ".join(
        f"{name} {value / MB:.1f}" for name, value in result["peak"].items() if name != "Total"))


if __name__ == "__main__":
    main()
