"""Count the operators a chapter's training step dispatches on the host, plain and DTensor, eager and compiled.

    python dev/count_host_ops.py --table                    # every case below, eager and --compile; then the table
    python dev/count_host_ops.py --table --cases 04 07-2    # only these (chapter, or chapter-processes)
    python dev/count_host_ops.py --table --print-only       # the table of the runs already in --root
    torchrun --standalone --nproc-per-node 2 dev/count_host_ops.py --out outputs/host-ops/07-2p-compiled \\
        07-2d-parallel/train_llm.py --tp 2 --seq-length 64 --batch-size 2 --max-steps 4 --log-freq 1000 --compile
    python dev/count_host_ops.py --dry-run 07 --nnodes 1 --nproc-per-node 8 -m data/configs/llama-3.1-8b --tp 8 \\
        --seq-length 2048 --batch-size 1    # one rank of a real-sized job, under tools/dry_run.py's fakes

On a GPU every aten operator a step dispatches costs the host ~10-60 us, one with a DTensor argument more (sharding
propagation); a host slower than its GPU leaves the GPU waiting. With --out, the script (everything after its path
goes to it) runs as __main__ under a TorchDispatchMode that counts, per training step (from the first forward pass
with gradients after an optimizer step to the end of the next optimizer step, as in tools/measure_step.py):

* "dtensor": dispatches whose arguments include a DTensor; DTensor then turns each into operators on its local
  tensors, which come back to the mode and count as plain;
* "plain": every other operator, less those on FakeTensors (DTensor's shape propagation computes nothing) and the
  AsyncCollectiveTensor wrappers (the wait and the operator they unwrap to count);
* "layer_forwards": forward calls of decoder layers (modules named *DecoderLayer) with gradients on: layers on this
  rank x micro-batches, the divisor of the table's "per layer" column.

Each rank writes OUT/rank-<rank>.json. Under --compile (each decoder layer's forward compiled by inductor) a
compiled graph's kernels dispatch no operator; its extern kernels (matmuls, attention) and its wrappers' still do.
The mode sets ignore_compile_internals, so dynamo compiles under it and the mode sees only the compiled code's
runtime (a mode without it makes torch.compile fall back to eager).

--table runs every case of CASES (torchrun for all but chapter 01) with SHARED_ARGS, into --root, and prints a
Markdown table of the medians of steps 2..N on rank 0 (step 1 builds AdamW's state and compiles).
--dry-run runs tools/dry_run.py's dry run (fake process group, FakeTensorMode; two steps) under the same counter and
prints step 2's counts: there every tensor is fake, so FakeTensor operators count as plain. Not with --compile:
dynamo skips every frame under the dry run's memory tracker (a dispatch mode without ignore_compile_internals).
"""

import argparse
import atexit
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = {path.name[:2]: path for path in sorted(REPO_ROOT.glob("[01][0-9]-*")) if (path / "train_llm.py").is_file()}
# NOTE: (chapter, processes, layout flags); 06's tensor-parallel degree is its world size.
CASES = [("01", 1, []), ("02", 1, []), ("03", 1, []), ("04", 1, []), ("05", 1, []), ("06", 1, []),
         ("07", 1, ["--tp", "1"]), ("08", 1, ["--pp", "1"]), ("09", 1, ["--cp", "1"]), ("10", 1, ["--ep", "1"]),
         ("11", 1, ["--tp", "1", "--pp", "1", "--cp", "1"]),
         ("06", 2, []), ("07", 2, ["--tp", "2"]), ("08", 2, ["--pp", "2"]), ("09", 2, ["--cp", "2"]),
         ("10", 2, ["--ep", "2"]), ("11", 4, ["--tp", "2", "--pp", "2"])]
SHARED_ARGS = ["--seq-length", "64", "--batch-size", "2", "--max-steps", "4", "--log-freq", "1000", "--ckpt-freq",
               "1000", "--wandb-mode", "disabled", "--num-workers", "0"]
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage="%(prog)s --out DIR SCRIPT [ARGS ...]"
                                     "  |  %(prog)s --table [--cases ...]  |  %(prog)s --dry-run CHAPTER [ARGS ...]")
    parser.add_argument("--out", help="folder for one rank-<rank>.json per rank")
    parser.add_argument("--table", action="store_true", help="run CASES eager and compiled, print the Markdown table")
    parser.add_argument("--root", default="outputs/host-ops", help="--table's folder of runs")
    parser.add_argument("--cases", nargs="*", help="--table: only these, e.g. 04 07-2 (chapter[-processes])")
    parser.add_argument("--print-only", action="store_true", help="--table: print the runs already in --root")
    parser.add_argument("--dry-run", metavar="CHAPTER", help="count one rank of tools/dry_run.py's dry run (first, "
                        "then tools/dry_run.py's arguments)")
    parser.add_argument("script", nargs="?", help="the training script, e.g. 07-2d-parallel/train_llm.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    if sys.argv[1:2] == ["--dry-run"] and len(sys.argv) > 2:
        return count_dry_run(sys.argv[2], sys.argv[3:])
    args = parser.parse_args()
    if args.table:
        return run_table(Path(args.root), args.cases, args.print_only)
    if not args.out or not args.script:
        parser.error("give --out DIR and the script to run, --table, or --dry-run CHAPTER")
    script = Path(args.script)
    counter = OpCounter(Path(args.out))
    counter.start()
    sys.argv = [str(script), *args.script_args]
    sys.path[0] = str(script.resolve().parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        counter.stop()


# ---------------------------------------------------------------------------------------------------------------------
# The counter


class OpCounter:
    """Counts the operators of each training step in this process."""

    def __init__(self, out_dir=None, count_fake=False):
        self.out_dir, self.count_fake = out_dir, count_fake
        self.rank, self.world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.pid = os.getpid()
        self.steps, self.current, self.optimizer_depth = [], None, 0
        self.hooks, self.mode = [], None

    def start(self, enter_mode=True):
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.hooks = [register_module_forward_pre_hook(self.on_forward),
                      register_optimizer_step_pre_hook(self.on_optimizer_step_begin),
                      register_optimizer_step_post_hook(self.on_optimizer_step_end)]
        self.mode = make_counting_mode(self)
        if enter_mode:
            self.mode.__enter__()
        atexit.register(self.write)

    def stop(self, exit_mode=True):
        if exit_mode:
            self.mode.__exit__(None, None, None)
        for hook in self.hooks:
            hook.remove()
        self.write()

    def on_forward(self, module, inputs):
        import torch

        # NOTE: dynamo traces this hook for the modules inside a compiled layer; they run in its graph, not here.
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        if self.current is None and self.optimizer_depth == 0:
            self.current = {"step": len(self.steps) + 1, "plain": Counter(), "dtensor": Counter(), "layer_forwards": 0}
        if self.current is not None and type(module).__name__.endswith("DecoderLayer"):
            self.current["layer_forwards"] += 1

    def on_optimizer_step_begin(self, optimizer, args, kwargs):
        self.optimizer_depth += 1

    def on_optimizer_step_end(self, optimizer, args, kwargs):
        self.optimizer_depth -= 1
        if self.optimizer_depth == 0 and self.current is not None:
            step, self.current = self.current, None
            self.steps.append({"step": step["step"], "plain": sum(step["plain"].values()),
                               "dtensor": sum(step["dtensor"].values()), "layer_forwards": step["layer_forwards"],
                               "plain_ops": dict(step["plain"].most_common()),
                               "dtensor_ops": dict(step["dtensor"].most_common())})

    def write(self):
        # NOTE: a forked DataLoader worker inherits the atexit hook and the steps; only the rank writes.
        if self.out_dir is None or os.getpid() != self.pid:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        result = {"rank": self.rank, "world_size": self.world_size, "steps": self.steps}
        (self.out_dir / f"rank-{self.rank}.json").write_text(json.dumps(result, indent=1))


def make_counting_mode(counter):
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountingMode(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls):
            # NOTE: off while dynamo and inductor compile, on while the compiled code runs; without it torch.compile
            # runs every layer eagerly under a mode.
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            step = counter.current
            if any(issubclass(t, DTensor) for t in types):
                if step is not None:
                    step["dtensor"][str(func)] += 1
                return NotImplemented
            if any(issubclass(t, AsyncCollectiveTensor) for t in types):
                return NotImplemented
            fake = any(issubclass(t, FakeTensor) for t in types)
            # NOTE: prim.device: what a FakeTensor asks of itself, which a real tensor answers without an operator.
            if step is not None and (not fake or counter.count_fake and func.namespace != "prim"):
                step["plain"][str(func)] += 1
            return func(*args, **(kwargs or {}))

    return CountingMode()


# ---------------------------------------------------------------------------------------------------------------------
# The table


def run_table(root, selected, print_only):
    cases = [case for case in CASES if not selected or case[0] in selected or f"{case[0]}-{case[1]}" in selected]
    for chapter, processes, flags in cases if not print_only else []:
        for compiled in [False, True] if chapter >= "04" else [False]:
            out = root / run_name(chapter, processes, compiled)
            script = CHAPTERS[chapter] / "train_llm.py"
            launcher = [sys.executable] if chapter == "01" else [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
            with tempfile.TemporaryDirectory() as save_dir:
                command = [*launcher, __file__, "--out", str(out), str(script), *flags, *SHARED_ARGS,
                           "--save-dir", save_dir, *(["--compile"] if compiled else [])]
                print(f"$ {' '.join(command[1:])}", file=sys.stderr, flush=True)
                finished = subprocess.run(command, env={**os.environ, **ENVIRONMENT}, cwd=REPO_ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if finished.returncode != 0:
                print(finished.stdout[-3000:], file=sys.stderr)
                raise SystemExit(f"error: {chapter} at {processes} processes{' compiled' if compiled else ''} failed")
    print_table(root, cases)


def run_name(chapter, processes, compiled):
    return f"{chapter}-{processes}p-{'compiled' if compiled else 'eager'}"


def median_counts(out_dir):
    """{plain, dtensor, all, per_layer}: the medians over steps 2..N on rank 0 (None if the run is missing)."""
    path = out_dir / "rank-0.json"
    if not path.is_file():
        return None
    steps = json.loads(path.read_text())["steps"][1:]
    if not steps:
        return None
    median = lambda values: statistics.median(values)  # noqa: E731
    counts = {"plain": median([s["plain"] for s in steps]), "dtensor": median([s["dtensor"] for s in steps])}
    counts["all"] = counts["plain"] + counts["dtensor"]
    counts["per_layer"] = median([(s["plain"] + s["dtensor"]) / max(s["layer_forwards"], 1) for s in steps])
    counts["layer_forwards"] = median([s["layer_forwards"] for s in steps])
    return counts


def print_table(root, cases):
    base = {compiled: median_counts(root / run_name("04", 1, compiled)) for compiled in [False, True]}
    print("| chapter | layout | eager: plain | DTensor | all | per layer | x 04 (all, DTensor) "
          "| --compile: plain | DTensor | all | per layer | x 04 (all, DTensor) |")
    print("|---|---|" + "--:|" * 10)
    for chapter, processes, flags in cases:
        cells = []
        for compiled in [False, True]:
            counts = median_counts(root / run_name(chapter, processes, compiled))
            if counts is None:
                cells += ["-"] * 5
                continue
            ratio = "-" if base[compiled] is None else (
                f"{counts['all'] / base[compiled]['all']:.2f}, "
                + (f"{counts['dtensor'] / base[compiled]['dtensor']:.1f}" if base[compiled]["dtensor"] else "-"))
            cells += [f"{counts['plain']:.0f}", f"{counts['dtensor']:.0f}", f"{counts['all']:.0f}",
                      f"{counts['per_layer']:.0f}", ratio]
        layout = " ".join([f"{processes} proc" + "s" * (processes > 1), *flags])
        print(f"| {CHAPTERS[chapter].name[:2]} | {layout} | " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------------------------------------------------
# The dry run


def count_dry_run(chapter, arguments):
    """tools/dry_run.py's dry run of one rank, counted: step 2's operators (every tensor is a FakeTensor there)."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    import dry_run
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    parser = argparse.ArgumentParser(prog="count_host_ops.py --dry-run")
    parser.add_argument("chapter", type=dry_run.chapter_number)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    args, chapter_args = parser.parse_known_args([chapter, *arguments])
    if not any(arg.startswith("--dtype") for arg in chapter_args):
        chapter_args = [*chapter_args, "--dtype", "bfloat16"]
    counter = OpCounter(count_fake=True)
    counter.start(enter_mode=False)
    # NOTE: the memory tracker returns NotImplemented for DTensor operators, which then skip the modes below it:
    # the counting mode goes above it, entered and left with it.
    for tracker in [MemTracker, FSDPMemTracker]:
        enter, exit = tracker.__enter__, tracker.__exit__
        tracker.__enter__ = lambda self, enter=enter: (enter(self), counter.mode.__enter__())[0]
        tracker.__exit__ = lambda self, *args, exit=exit: (counter.mode.__exit__(*args), exit(self, *args))[1]
    try:
        dry_run.dry_run(args.chapter, chapter_args, args.rank, args.nproc_per_node, args.nnodes * args.nproc_per_node)
    finally:
        counter.stop(exit_mode=False)
    # NOTE: the dry run ends in its optimizer's own post-hook, which runs before the global one that ends a step.
    if counter.current is not None:
        counter.optimizer_depth = 1
        counter.on_optimizer_step_end(None, (), {})
    for step in counter.steps:
        total, layers = step["plain"] + step["dtensor"], max(step["layer_forwards"], 1)
        print(f"step {step['step']}: {step['plain']} plain + {step['dtensor']} DTensor = {total} operators, "
              f"{step['layer_forwards']} layer forwards, {total / layers:.0f} per layer forward")
        print("  most dispatched:", ", ".join(f"{name} {n}" for name, n in list(step["plain_ops"].items())[:8]))


if __name__ == "__main__":
    main()
