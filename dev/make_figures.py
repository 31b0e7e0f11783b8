"""Regenerate every figure in the READMEs from real CPU runs of the chapters, and the tables the READMEs draw from
tools/estimate_memory.py:

    python dev/make_figures.py            # all figures into docs/figures/ and all tables into the READMEs
    python dev/make_figures.py --tables   # only the tables (seconds; nothing is trained)
    python dev/make_figures.py --fast     # few steps, into a temporary folder (what the tests run)
    python dev/make_figures.py --dry-runs # only the dry-run tables (tools/dry_run.py, 8 runs: 9 minutes on 2 cores)

The figures, and the runs each one is drawn from (the tables below list them; a new chapter adds its runs there):

    parity.png                  chapter 01's loss curve with every other chapter's on top, same global batch
    memory_per_rank.png         parameters, gradients and optimizer state held per rank by DDP, ZeRO-1 and FSDP
                                at 1, 2 and 4 ranks (tools/measure_step.py), against 16, 8 + 8/N and 16/N bytes
    lr_schedule.png             the learning rate chapter 01 logs, step by step, against its formula
    activation_checkpointing.png  the peak of a step above the model state, chapter 05 with and without
                                --activation-checkpointing, measured and estimated; and the estimate for 405B
    batch_size_lr.png           chapter 01 at global batches of 2, 8 and 32 on the same tokens, the learning
                                rate unscaled, times the square root of the factor, or times the factor
    08-pipeline-parallel/pipeline-schedules.png   GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble and ZBV
                                timelines measured at 4 micro-batches (08-pipeline-parallel/measure_pipeline.py;
                                its bubble table takes longer: run it alone)
    09-context-parallel/load-balanced-layout.png  which rank computes which part of the causal attention, from
                                chapter 09's own token split (09-context-parallel/draw_context_parallel_layout.py)
    11-4d-parallel/parity-matrix.png  chapter 11 in five layouts of tp, pp, cp and dp against chapter 01: the
                                largest loss and gradient-norm differences of each, and the loss differences per step

Everything runs on the CPU with the bundled tiny model and corpus; a full run took 35 minutes on 2 busy cores (32, and 3 for batch_size_lr)
(--reuse redraws from the runs a previous call left in --work-dir, in seconds).
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "tools"
FIGURES = REPO / "docs" / "figures"
sys.path.insert(0, str(TOOLS))
import estimate_memory  # noqa: E402
import plot_runs  # noqa: E402
from measure_step import read_measurements  # noqa: E402

# NOTE: every chapter folder, by its number ("01": "01-single-gpu", ...), as the tests name them.
CHAPTERS = {path.parent.name[:2]: path.parent.name for path in sorted(REPO.glob("[0-9][0-9]-*/train_llm.py"))}
COMMON = ["--seq-length", "64", "--log-freq", "1", "--ckpt-freq", "100000", "--warmup-steps", "5",
          "--num-workers", "0", "--wandb-mode", "disabled"]

# The parity figure: every run trains the same global batch of 4 sequences, from the same seeded weights, so every
# curve should be chapter 01's. (label, chapter, processes or None for one plain process, flags). A new chapter adds
# a line here.
PARITY_RUNS = [
    ("01, one process, batch 4", "01", None, ["--batch-size", "4"]),
    ("02 DDP, 2 ranks x 2", "02", 2, ["--batch-size", "2"]),
    ("04 FSDP, 2 ranks x 2", "04", 2, ["--batch-size", "2"]),
    ("06 TP 2, batch 4", "06", 2, ["--batch-size", "4"]),
    ("07 dp 2 x tp 2, 2 per dp rank", "07", 4, ["--batch-size", "2", "--tp", "2"]),
    ("08 pp 2, 1F1B, 2 micro-batches", "08", 2, ["--batch-size", "4", "--pp", "2"]),
    ("09 cp 2, ring attention", "09", 2, ["--batch-size", "4", "--cp", "2"]),
]
# Chapter 11's parity matrix: (label, processes, flags), each with chapter 01's global batch of 4 (--batch-size 4 / dp),
# against chapter 01 with --batch-size 4.
PARITY_MATRIX_RUNS = [
    ("tp 2 x pp 2 x dp 2", 8, ["--batch-size", "2", "--tp", "2", "--pp", "2"]),
    ("tp 2 x cp 2 x dp 2", 8, ["--batch-size", "2", "--tp", "2", "--cp", "2"]),
    ("pp 2 x cp 2 x tp 2", 8, ["--batch-size", "4", "--tp", "2", "--pp", "2", "--cp", "2"]),
    ("tp 2 x pp 2", 4, ["--batch-size", "4", "--tp", "2", "--pp", "2"]),
    ("pp 2 x cp 2", 4, ["--batch-size", "4", "--pp", "2", "--cp", "2"]),
]
# The memory figure: (label, chapter, flags, the estimator's layout for N ranks, bytes per parameter at N ranks).
MEMORY_RUNS = [
    ("DDP", "02", [], lambda n: {"dp": n}, lambda n: 16),
    ("ZeRO-1", "02", ["--zero1"], lambda n: {"dp": n, "zero1": True}, lambda n: 8 + 8 / n),
    ("FSDP", "04", [], lambda n: {"dp": n, "fsdp": True}, lambda n: 16 / n),
]


def main():
    parser = argparse.ArgumentParser(
        description="Regenerate the READMEs' figures from CPU runs of the chapters (docs/figures/*.png, and 08's and 09's own) and their "
                    "tables from tools/estimate_memory.py.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--fast", action="store_true",
                        help="3 steps, two parity runs, one process per run otherwise, all in a temporary folder: "
                             "a check of the tool, not the figures")
    parser.add_argument("--tables", action="store_true", help="only rewrite the README tables (no training)")
    parser.add_argument("--dry-runs", action="store_true",
                        help="only rewrite the README tables of tools/dry_run.py's runs (minutes each at 70B and 405B)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the figures go (default: docs/figures, or a temporary folder with --fast)")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--only", nargs="+", choices=list(FIGURE_MAKERS), help="make only these figures")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs a previous call left in --work-dir instead of training again")
    args = parser.parse_args()
    if args.dry_runs:
        changed = write_dry_run_tables(Path(args.work_dir or tempfile.mkdtemp(prefix="make-figures-")), args.reuse)
        print(f"dry-run tables: {', '.join(changed) if changed else 'all up to date'}")
        return
    if args.tables:
        changed = write_readme_tables()
        print(f"tables: {', '.join(changed) if changed else 'all up to date'}")
        return
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="make-figures-"))
    out_dir = args.out_dir or (work_dir / "figures" if args.fast else FIGURES)
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(work_dir, fast=args.fast, reuse=args.reuse)
    for name in args.only or FIGURE_MAKERS:
        started = time.perf_counter()
        path = FIGURE_MAKERS[name](runner, out_dir)
        print(f"wrote {path} ({time.perf_counter() - started:.0f}s)", flush=True)
    if not args.fast and not args.out_dir:
        changed = write_readme_tables(runner)
        print(f"tables: {', '.join(changed) if changed else 'all up to date'}")


class Runner:
    """Runs chapters' scripts on the CPU, each in a folder of its own, and stops with the log tail if one fails."""

    def __init__(self, work_dir, fast, reuse=False):
        self.work_dir = Path(work_dir)
        self.fast = fast
        self.reuse = reuse
        self.measured = {}  # (label, world size): rank 0's measurement, for the tables drawn from runs
        self.env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}

    def train(self, name, chapter, nproc, args, measure=False):
        """Train; returns the experiment folder (and, with measure=True, the measurements of every rank)."""
        experiment = self.work_dir / "outputs" / name
        measured_dir = self.work_dir / "measured" / name
        if self.reuse and (experiment / "metrics.jsonl").exists() and (not measure or measured_dir.exists()):
            return (experiment, read_measurements(measured_dir)) if measure else experiment
        shutil.rmtree(experiment, ignore_errors=True)
        launcher = [sys.executable] if nproc is None else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        if measure:
            shutil.rmtree(measured_dir, ignore_errors=True)
            launcher = [*launcher, str(TOOLS / "measure_step.py"), "--out", str(measured_dir)]
        script = REPO / CHAPTERS[chapter] / "train_llm.py"
        command = [*launcher, str(script), *COMMON, *args, "--save-dir", str(self.work_dir / "outputs"), "-e", name]
        self.run_logged(name, command)
        return (experiment, read_measurements(measured_dir)) if measure else experiment

    def run_tool(self, name, tool, *args):
        """Run another figure tool of tools/."""
        self.run_logged(name, [sys.executable, str(TOOLS / tool), *map(str, args)])

    def run_logged(self, name, command):
        """Run a command with its output in the work folder's logs/NAME.log; stop with the log's tail if it fails."""
        log = self.work_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as log_file:
            result = subprocess.run(command, cwd=self.work_dir, env=self.env, stdout=log_file,
                                    stderr=subprocess.STDOUT, timeout=3600)
        if result.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-30:])
            raise SystemExit(f"error: {' '.join(command)} failed (exit {result.returncode}); its log {log} ends:\n{tail}")


# ---------------------------------------------------------------------------------------------------------------------
# The figures


def make_parity(runner, out_dir):
    steps = 3 if runner.fast else 100
    runs = []
    for index, (label, chapter, nproc, args) in enumerate(PARITY_RUNS[:2] if runner.fast else PARITY_RUNS):
        experiment = runner.train(f"parity-{index}-{chapter}", chapter, nproc, [*args, "--max-steps", str(steps)])
        runs.append((label, plot_runs.read_metrics(experiment)))
    worst = max(abs(a["loss"] - b["loss"]) for _, records in runs[1:] for a, b in zip(runs[0][1], records))
    figure = plot_runs.plot_runs(runs, ["loss", "difference"], width=7.5,
                                 title=f"Every chapter trains chapter 01's loss curve\n{steps} steps of the same "
                                       f"global batch (4 x 64 tokens), fp32 on CPUs; largest difference {worst:.1e}")
    return save(figure, out_dir / "parity.png")


def make_parity_matrix(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = 3 if runner.fast else 20
    layouts = PARITY_MATRIX_RUNS[3:4] if runner.fast else PARITY_MATRIX_RUNS
    reference = plot_runs.read_metrics(runner.train("parity-matrix-01", "01", None, ["--batch-size", "4",
                                                                                      "--max-steps", str(steps)]))
    figure, (table_ax, curve_ax) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [1.25, 1]})
    rows = []
    for index, (label, nproc, args) in enumerate(layouts):
        records = plot_runs.read_metrics(runner.train(f"parity-matrix-{index}", "11", nproc,
                                                      [*args, "--max-steps", str(steps)]))
        loss_differences = [abs(a["loss"] - b["loss"]) for a, b in zip(reference, records, strict=True)]
        norm_difference = max(abs(b["grad_norm"] / a["grad_norm"] - 1) for a, b in zip(reference, records))
        rows.append([label, str(nproc), f"{max(loss_differences):.1e}", f"{norm_difference:.1e}"])
        # NOTE: equal fp32 losses differ by 0: drawn at 1e-9 on the log scale.
        curve_ax.plot([r["step"] for r in records], [max(d, 1e-9) for d in loss_differences], marker="o",
                      markersize=3, label=label)
    table_ax.axis("off")
    table = table_ax.table(cellText=rows, colLabels=["layout", "ranks", "max |loss - 01's|",
                                                     "max |grad norm / 01's - 1|"], loc="center",
                           cellLoc="center", colWidths=[0.3, 0.1, 0.28, 0.32])
    table.auto_set_font_size(False)
    table.set_fontsize(9)
    table.scale(1, 1.6)
    curve_ax.set_yscale("log")
    curve_ax.set_xlabel("step")
    curve_ax.set_ylabel("|loss - chapter 01's|")
    curve_ax.grid(True, alpha=0.3)
    curve_ax.legend(fontsize="small")
    figure.suptitle(f"Chapter 11 against chapter 01: {steps} steps of the same global batch (4 x 64 tokens), fp32 on "
                    f"CPUs, clipping at 1.0", fontsize="medium")
    figure.tight_layout()
    return save(figure, chapter_figure(out_dir, "11", "parity-matrix.png"))


def make_memory_per_rank(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    world_sizes = [1] if runner.fast else [1, 2, 4]
    config = estimate_memory.load_config(REPO / "data" / "tiny-llama")
    num_params = estimate_memory.estimate_step(config, estimate_memory.Layout())["num_parameters"]
    figure, axes = plt.subplots(1, len(MEMORY_RUNS), figsize=(10, 3.8), sharey=True)
    colours = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868"}
    for ax, (label, chapter, flags, layout, bytes_per_param) in zip(axes, MEMORY_RUNS):
        for world_size in world_sizes:
            args = [*flags, "--max-steps", "1", "--batch-size", "1"]
            _, measurements = runner.train(f"memory-{label}-{world_size}", chapter, world_size, args, measure=True)
            held = measurements[0]["memory_held"]
            runner.measured[label, world_size] = measurements[0]
            estimate = estimate_memory.estimate_step(config, estimate_memory.Layout(dtype="float32",
                                                                                    **layout(world_size)))
            if (held["parameters"], held["gradients"], held["optimizer_state"]) != (
                    estimate["params_bytes"], estimate["grads_bytes"], estimate["optimizer_bytes"]):
                raise SystemExit(f"error: {label} on {world_size} ranks holds {held}, tools/estimate_memory.py "
                                 f"says {estimate['params_bytes']}, {estimate['grads_bytes']}, "
                                 f"{estimate['optimizer_bytes']}: one of them is wrong")
            bottom = 0.0
            for kind, colour in colours.items():
                ax.bar(world_size, held[kind] / 1e6, bottom=bottom, width=0.6, color=colour,
                       label=kind.replace("_", " ") if world_size == world_sizes[0] else None)
                bottom += held[kind] / 1e6
        line_x = [1 + x / 10 for x in range(10 * (world_sizes[-1] - 1) + 3)]
        ax.plot(line_x, [bytes_per_param(x) * num_params / 1e6 for x in line_x], color="black", linewidth=1.2)
        ax.set_title(f"{label} (chapter {chapter})\n{bytes_per_param_label(label)}", fontsize="medium")
        ax.set_xticks(world_sizes)
        ax.set_xlabel("ranks N")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_ylabel("MB held by rank 0 after a step")
    handles, labels = axes[0].get_legend_handles_labels()
    theory = f"bytes per parameter x {num_params / 1e6:.2f}M parameters (the text)"
    figure.legend([*handles, plt.Line2D([], [], color="black")], [*labels, theory], loc="lower center", ncol=4,
                  fontsize="small", frameon=False)
    figure.suptitle(f"What each rank holds of the {num_params / 1e6:.2f}M-parameter tiny Llama, measured (fp32)",
                    fontsize="medium")
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    return save(figure, out_dir / "memory_per_rank.png")


def bytes_per_param_label(label):
    return {"DDP": "16 bytes/parameter", "ZeRO-1": "8 + 8/N bytes/parameter", "FSDP": "16/N bytes/parameter"}[label]


def make_lr_schedule(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, warmup = (20, 4) if runner.fast else (200, 20)
    experiment = runner.train("lr-schedule", "01", None, ["--max-steps", str(steps), "--warmup-steps", str(warmup),
                                                          "--batch-size", "1", "--seq-length", "16"])
    records = plot_runs.read_metrics(experiment)
    chapter01 = load_chapter_module("01")
    peak_lr = 1e-3
    # NOTE: the lr logged at step s is the one after that step's scheduler update, factor(s): the next step's.
    formula = [peak_lr * chapter01.warmup_cosine_lr_factor(step, warmup, steps) for step in range(1, steps + 1)]
    figure, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(range(1, steps + 1), formula, color="black", linewidth=1, label="warmup_cosine_lr_factor(step) x --lr")
    ax.plot([r["step"] for r in records], [r["lr"] for r in records], "o", markersize=3, color="#dd8452",
            label="lr logged in metrics.jsonl", markevery=max(1, steps // 50))
    ax.axvline(warmup, color="grey", linestyle=":", linewidth=1)
    ax.annotate(f"end of warm-up (step {warmup})", (warmup, peak_lr), xytext=(6, -14), textcoords="offset points",
                fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title(f"Chapter 01's learning rate: warm-up over {warmup} steps, cosine to --lr / 10 at step {steps}",
                 fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, out_dir / "lr_schedule.png")


def make_activation_checkpointing(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seq_lengths = [64] if runner.fast else [64, 128, 256, 512]
    config = estimate_memory.load_config(REPO / "data" / "tiny-llama")
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for checkpointing, colour in [(False, "#c44e52"), (True, "#4c72b0")]:
        measured, estimated = [], []
        for seq_length in seq_lengths:
            flags = ["--max-steps", "1", "--batch-size", "2", "--seq-length", str(seq_length)]
            flags += ["--activation-checkpointing"] if checkpointing else []
            name = f"activations-{seq_length}{'-checkpointing' if checkpointing else ''}"
            _, measurements = runner.train(name, "05", None, flags, measure=True)
            measured.append(measurements[0]["steps"][0]["peak_live_bytes_above_start"] / 1e6)
            layout = estimate_memory.Layout(fsdp=True, split_root_group=True, activation_checkpointing=checkpointing,
                                            batch_size=2, seq_length=seq_length, dtype="float32")
            estimated.append(estimate_memory.estimate_step(config, layout)["step_peak_above_start_bytes"] / 1e6)
        label = "with" if checkpointing else "without"
        left.plot(seq_lengths, measured, "o-", color=colour, label=f"{label} checkpointing, measured")
        left.plot(seq_lengths, estimated, "x--", color=colour, label=f"{label}, tools/estimate_memory.py")
        big = estimate_memory.load_config(REPO / "data" / "configs" / "llama-3.1-405b")
        lengths = [512, 1024, 2048, 4096, 8192]
        activations = [estimate_memory.estimate_step(big, estimate_memory.Layout(
            fsdp=True, dp=64, split_root_group=True, activation_checkpointing=checkpointing, batch_size=1,
            seq_length=length, dtype="bfloat16"))["activations_bytes"] / 1e9 for length in lengths]
        right.plot(lengths, activations, "o-", color=colour, label=f"{label} checkpointing")
    left.set_xscale("log", base=2)
    left.set_xticks(seq_lengths, [str(s) for s in seq_lengths])
    left.set_xlabel("--seq-length (batch 2)")
    left.set_ylabel("MB above the model state")
    left.set_title("Chapter 05, tiny Llama, fp32 on a CPU:\npeak of a step above the model state", fontsize="medium")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xticks(lengths, [f"{s:,}" for s in lengths])
    right.set_xlabel("--seq-length (batch 1)")
    right.set_ylabel("GB per GPU")
    right.set_title("Llama 3.1 405B, bf16 (estimate): activations\nsaved for backward, per GPU", fontsize="medium")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, out_dir / "activation_checkpointing.png")


def make_pipeline_schedules(runner, out_dir):
    path = chapter_figure(out_dir, "08", "pipeline-schedules.png")
    # NOTE: fast, one schedule of one stage per rank and ZBV's two in a V, with its weight passes.
    fast = ["--steps", "3", "--schedules", "1f1b", "zbv"] if runner.fast else []
    runner.run_tool("pipeline-schedules", REPO / CHAPTERS["08"] / "measure_pipeline.py", "--microbatches", "4", *fast,
                    "--figure", path)
    return path


def make_context_parallel_layout(runner, out_dir):
    path = chapter_figure(out_dir, "09", "load-balanced-layout.png")
    runner.run_tool("context-parallel-layout", REPO / CHAPTERS["09"] / "draw_context_parallel_layout.py", "--out", path)
    return path


# The batch-size figure (related-topics/batch-size-and-learning-rate.md): chapter 01 at global batches of 2, 8 and
# 32 sequences, on the same tokens (fewer steps as the batch grows; warm-up over the same tokens too), with the peak
# lr unscaled, times the square root of the batch's factor, or times the factor.
BATCH_BASE, BATCH_BASE_STEPS, BATCH_BASE_WARMUP, BATCH_BASE_LR = 2, 256, 16, 1e-3
LR_RULES = {"unscaled": lambda k: 1.0, "square root": lambda k: k ** 0.5, "linear": lambda k: float(k)}


def batch_size_runs(runner):
    """{(factor, rule): metrics records} of the batch-size experiment; the factor 1 run serves all three rules."""
    factors, base_steps = ((1, 4), 16) if runner.fast else ((1, 4, 16), BATCH_BASE_STEPS)
    runs, trained = {}, {}
    for factor in factors:
        for rule, scale in LR_RULES.items():
            lr = BATCH_BASE_LR * scale(factor)
            flags = ["--batch-size", str(BATCH_BASE * factor), "--max-steps", str(base_steps // factor),
                     "--warmup-steps", str(max(1, BATCH_BASE_WARMUP // factor)), "--lr", f"{lr:g}"]
            name = f"batch-{BATCH_BASE * factor}-lr-{lr:g}"
            if name not in trained:
                trained[name] = plot_runs.read_metrics(runner.train(name, "01", None, flags))
            runs[factor, rule] = trained[name]
    return runs


def tokens_seen(record, factor):
    return record["step"] * BATCH_BASE * factor * 64


def final_loss(records):
    """The mean loss over the last eighth of the tokens: one step's loss is one batch's, noisier the smaller it is."""
    return sum(record["loss"] for record in records[-max(1, len(records) // 8):]) / max(1, len(records) // 8)


def make_batch_size_lr(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = batch_size_runs(runner)
    factors = sorted({factor for factor, _ in runs})
    colours = {"unscaled": "#c44e52", "square root": "#4c72b0", "linear": "#55a868"}
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for (factor, rule), records in runs.items():
        if factor == 1 and rule != "unscaled":
            continue
        style = {1: ":", 4: "--", 16: "-"}[factor]
        colour = "black" if factor == 1 else colours[rule]
        label = f"batch {BATCH_BASE}, lr {BATCH_BASE_LR:g}" if factor == 1 else f"batch {BATCH_BASE * factor}, {rule}"
        left.plot([tokens_seen(r, factor) for r in records], [r["loss"] for r in records], style, color=colour,
                  label=label, linewidth=1.2 if factor == 1 else 1.5)
    for rule, colour in colours.items():
        right.plot([BATCH_BASE * f for f in factors], [final_loss(runs[f, rule]) for f in factors], "o-",
                   color=colour, label=f"lr {rule}")
    tokens = tokens_seen(runs[1, "unscaled"][-1], 1)
    left.set_xlabel("tokens trained on")
    left.set_ylabel("training loss")
    left.set_title(f"Chapter 01, the same {tokens:,} tokens:\nthe loss at each global batch", fontsize="medium")
    right.set_xscale("log", base=2)
    right.set_xticks([BATCH_BASE * f for f in factors], [str(BATCH_BASE * f) for f in factors])
    right.set_xlabel("global batch (sequences of 64 tokens)")
    right.set_ylabel("loss over the last eighth of the tokens")
    right.set_title("The same tokens in fewer, larger steps:\nwhich peak learning rate keeps the loss",
                    fontsize="medium")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, out_dir / "batch_size_lr.png")


MIXED_PRECISION_MODES = ["fp32", "autocast", "pure bf16"]


def memorize_one_batch(mode, steps=20):
    """related-topics/mixed-precision.md's experiment: the bundled model learns one batch of 4 x 64 random tokens with
    AdamW (lr 1e-3, no weight decay, seed 1) in fp32, under autocast (fp32 weights) or in pure bf16 (the model and
    AdamW's state in bf16). Returns each step's loss and the share of the norms' scales that never moved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "data" / "tiny-llama")
    batch = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if mode == "pure bf16":
        model = model.to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    norms = {name: param.detach().clone() for name, param in model.named_parameters() if name.endswith("norm.weight")}
    losses = []
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    parameters = dict(model.named_parameters())
    unchanged = sum((parameters[name].detach() == start).sum().item() for name, start in norms.items())
    return losses, unchanged / sum(start.numel() for start in norms.values())


def make_mixed_precision(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {mode: memorize_one_batch(mode, steps=3 if runner.fast else 20) for mode in MIXED_PRECISION_MODES}
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.8))
    for mode, (losses, unchanged) in runs.items():
        steps = range(1, len(losses) + 1)
        label = f"{mode}: final loss {losses[-1]:.3f}, norm scales unchanged {unchanged:.0%}"
        left.plot(steps, losses, label=label, linewidth=1.5)
        right.plot(steps, [loss - reference for loss, reference in zip(losses, runs["fp32"][0])], label=mode,
                   linewidth=1.5)
    left.set_ylabel("training loss (one batch, memorized)")
    left.set_title("The bundled model, one batch, AdamW at lr 1e-3", fontsize="medium")
    right.set_ylabel("loss minus fp32's")
    right.set_title("fp32 weights keep the small updates\nthat pure bf16 rounds away", fontsize="medium")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, out_dir / "mixed_precision.png")


def make_determinism(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = ["--max-steps", "3" if runner.fast else "20"]
    runs = {label: plot_runs.read_metrics(runner.train(name, "01", None, [*steps, *flags])) for label, name, flags in
            [("seed 0", "determinism-seed0", []), ("seed 0 again", "determinism-seed0-again", []),
             ("seed 1", "determinism-seed1", ["--seed", "1"])]}
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.6))
    for (label, records), style in zip(runs.items(), ["-", "--", "-"]):
        left.plot([r["step"] for r in records], [r["loss"] for r in records], style, label=label, linewidth=1.5)
    for label in ["seed 0 again", "seed 1"]:
        differences = [abs(a["loss"] - b["loss"]) for a, b in zip(runs["seed 0"], runs[label], strict=True)]
        # NOTE: equal losses differ by 0: drawn at 1e-9 on the log scale.
        right.plot([r["step"] for r in runs[label]], [max(d, 1e-9) for d in differences], marker="o", markersize=3,
                   label=f"{label}: largest {max(differences):.1e}")
    left.set_ylabel("training loss")
    left.set_title("Chapter 01, the same program three times", fontsize="medium")
    right.set_yscale("log")
    right.set_ylabel("|loss - seed 0's| (0 drawn at 1e-9)")
    right.set_title("The same seed: bitwise equal; another seed: another run", fontsize="medium")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    figure.tight_layout()
    return save(figure, out_dir / "determinism.png")


def make_data_loading(runner, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # NOTE: the page's experiment: chapter 01's defaults (batch 8 x 256 tokens), only the workers change.
    steps = 3 if runner.fast else 30
    runs = {workers: plot_runs.read_metrics(runner.train(f"data-loading-workers-{workers}", "01", None, [
        "--seq-length", "256", "--batch-size", "8", "--max-steps", str(steps), "--num-workers", str(workers)]))
        for workers in (0, 1, 2)}
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.6))
    for (workers, records), style in zip(runs.items(), ["-", "--", ":"]):
        left.plot([r["step"] for r in records], [r["loss"] for r in records], style, linewidth=1.5,
                  label=f"--num-workers {workers}")
    # NOTE: the median over the steps after the first tenth: the first steps start the workers and warm the caches.
    speeds = [statistics.median(r["tokens_per_second"] for r in records[len(records) // 10:])
              for records in runs.values()]
    bars = right.bar([str(workers) for workers in runs], speeds, color="#4c72b0")
    right.bar_label(bars, labels=[f"{speed:,.0f}" for speed in speeds], fontsize="small")
    left.set_xlabel("step")
    left.set_ylabel("training loss")
    left.set_title("The same sequences in the same order: the same losses", fontsize="medium")
    left.legend(fontsize="small")
    right.set_xlabel("--num-workers")
    right.set_ylabel("tokens/s (median of the logged steps)")
    right.set_title("The speed at each number of workers", fontsize="medium")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    figure.tight_layout()
    return save(figure, out_dir / "data_loading.png")


def make_preemption(runner, out_dir):
    """Chapter 01 stopped by SIGUSR1 once it has logged step 8 (or 1), resumed, against the run never stopped."""
    import signal

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_steps, stop_after = (3, 1) if runner.fast else (30, 8)
    flags = ["--max-steps", str(max_steps)]
    straight = plot_runs.read_metrics(runner.train("preemption-straight", "01", None, flags))
    experiment = runner.work_dir / "outputs" / "preemption-stopped"
    shutil.rmtree(experiment, ignore_errors=True)
    command = [sys.executable, str(REPO / CHAPTERS["01"] / "train_llm.py"), *COMMON, *flags,
               "--save-dir", str(runner.work_dir / "outputs"), "-e", experiment.name]
    process = subprocess.Popen(command, cwd=runner.work_dir, env=runner.env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics = experiment / "metrics.jsonl"
    while process.poll() is None and (not metrics.is_file() or len(metrics.read_text().splitlines()) < stop_after):
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    if process.wait(timeout=300) != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {process.returncode} after SIGUSR1")
    stopped_at = plot_runs.read_metrics(experiment)[-1]["step"]
    runner.run_logged("preemption-resumed", command)
    resumed = plot_runs.read_metrics(experiment)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10.5, 3.6))
    left.plot([r["step"] for r in straight], [r["loss"] for r in straight], label="never stopped", linewidth=2.5,
              alpha=0.5)
    left.plot([r["step"] for r in resumed], [r["loss"] for r in resumed], "--", label="stopped and resumed",
              linewidth=1.5)
    differences = [abs(a["loss"] - b["loss"]) for a, b in zip(straight, resumed, strict=True)]
    right.plot([r["step"] for r in resumed], [max(d, 1e-9) for d in differences], marker="o", markersize=3,
               label=f"largest {max(differences):.1e}")
    for ax in (left, right):
        ax.axvline(stopped_at + 0.5, color="grey", linestyle=":", label=f"SIGUSR1: saved step {stopped_at}, exit 0")
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    left.set_ylabel("training loss")
    left.set_title("Chapter 01 stopped by a signal, then started again", fontsize="medium")
    right.set_yscale("log")
    right.set_ylabel("|loss - the unstopped run's| (0 drawn at 1e-9)")
    right.set_title("The resumed run is the run never stopped", fontsize="medium")
    figure.tight_layout()
    return save(figure, out_dir / "preemption.png")


def chapter_figure(out_dir, chapter, name):
    """A figure that lives next to its chapter's README, or in --out-dir when one is given."""
    return REPO / CHAPTERS[chapter] / name if out_dir == FIGURES else out_dir / name


FIGURE_MAKERS = {
    "parity": make_parity,
    "memory_per_rank": make_memory_per_rank,
    "lr_schedule": make_lr_schedule,
    "activation_checkpointing": make_activation_checkpointing,
    "pipeline_schedules": make_pipeline_schedules,
    "context_parallel_layout": make_context_parallel_layout,
    "parity_matrix": make_parity_matrix,
    "batch_size_lr": make_batch_size_lr,
    "mixed_precision": make_mixed_precision,
    "determinism": make_determinism,
    "data_loading": make_data_loading,
    "preemption": make_preemption,
}


def save(figure, path):
    plot_runs.save_figure(figure, path, dpi=100)
    return path


def load_chapter_module(chapter):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"train_llm_{chapter}", REPO / CHAPTERS[chapter] / "train_llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------------
# The README tables, from tools/estimate_memory.py


def gigabytes(value):
    """1,623 GB, 635 GB, 101.5 GB, 5.1 GB: whole gigabytes from a thousand up, else one decimal (not .0)."""
    if value >= 1e12:
        return f"{value / 1e9:,.0f} GB"
    return f"{value / 1e9:,.1f}".removesuffix(".0") + " GB"


def table_04_zero_stages():
    """Chapter 04: per GPU on 8 GPUs, Llama-3.1-8B and -70B, for DDP, the ZeRO stages and FSDP, and FSDP's
    transient gathered weights."""
    models = {name: estimate_memory.load_config(REPO / "data" / "configs" / name)
              for name in ("llama-3.1-8b", "llama-3.1-70b")}
    rows = [("DDP", {}), ("ZeRO-1", {"zero1": True}), ("ZeRO-2", {"zero2": True}), ("FSDP (ZeRO-3)", {"fsdp": True})]
    lines = ["| per GPU, 8 GPUs | bytes per parameter | Llama-3.1-8B | Llama-3.1-70B |", "| --- | --- | --- | --- |"]
    for label, flags in rows:
        cells = []
        for config in models.values():
            estimate = estimate_memory.estimate_step(config, estimate_memory.Layout(dp=8, dtype="bfloat16", **flags))
            state = estimate["params_bytes"] + estimate["grads_bytes"] + estimate["optimizer_bytes"]
            cells.append(gigabytes(state))
            per_param = state / estimate["num_parameters"]
        lines.append(f"| {label} | {per_param:.3g} | {' | '.join(cells)} |")
    layer, root = [], []
    for config in models.values():
        groups = estimate_memory.fsdp_groups(estimate_memory.model_parameters(config),
                                             estimate_memory.model_dimensions(config),
                                             estimate_memory.Layout(dp=8, fsdp=True, dtype="bfloat16"),
                                             estimate_memory.rank_coordinates(estimate_memory.Layout(dp=8, fsdp=True)))
        layer.append(f"{groups['layer 0'].full_bytes / 1e9:.2f} GB a layer")
        root.append(f"{groups['root'].full_bytes / 1e9:.1f} GB")
    lines.append(f"| + FSDP's transient bf16 weights: one decoder layer (two while the next one is prefetched) | | "
                 f"{' | '.join(layer)} |")
    lines.append(f"| + the root group (embeddings and output head, gathered from forward to backward) | | "
                 f"{' | '.join(root)} |")
    return "\n".join(lines)


def table_05_model_state():
    """Chapter 05: Llama 3.1 405B's model state, in total and per GPU with FSDP on 64, 128 and 320 GPUs."""
    config = estimate_memory.load_config(REPO / "data" / "configs" / "llama-3.1-405b")
    sizes = [64, 128, 320]
    estimates = {n: estimate_memory.estimate_step(config, estimate_memory.Layout(dp=n, fsdp=True, dtype="bfloat16"))
                 for n in [1, *sizes]}
    header = ["| | total | " + " | ".join(f"per GPU, N = {n}" + (" (8 nodes)" if n == 64 else "") for n in sizes)
              + " |", "| --- | --- | " + " | ".join("---" for _ in sizes) + " |"]
    rows = [("fp32 weights", "params_bytes"), ("fp32 gradients", "grads_bytes"), ("AdamW moments", "optimizer_bytes")]
    lines = list(header)
    for label, key in rows:
        lines.append(f"| {label} | {gigabytes(estimates[1][key])} | "
                     + " | ".join(gigabytes(estimates[n][key]) for n in sizes) + " |")

    def state(n):
        return sum(estimates[n][key] for _, key in rows)

    lines.append(f"| **sum (16 bytes per parameter)** | **{gigabytes(state(1))}** | "
                 + " | ".join(f"**{gigabytes(state(n))}**" for n in sizes) + " |")
    return "\n".join(lines)


def table_05_activations():
    """Chapter 05: the activations of Llama 3.1 405B per GPU, with and without activation checkpointing."""
    config = estimate_memory.load_config(REPO / "data" / "configs" / "llama-3.1-405b")
    lengths = [512, 1024, 2048, 4096, 8192]
    lines = ["| `--seq-length` (batch 1) | " + " | ".join(f"{n:,}" for n in lengths) + " |",
             "| --- | " + " | ".join("---" for _ in lengths) + " |"]
    for label, checkpointing in [("without checkpointing: all 126 layers' activations, and the loss's fp32 logits", False),
                                 ("with activation checkpointing: the layer inputs, one layer recomputed, the logits",
                                  True)]:
        cells = []
        for length in lengths:
            layout = estimate_memory.Layout(dp=64, fsdp=True, split_root_group=True, batch_size=1, seq_length=length,
                                            activation_checkpointing=checkpointing, dtype="bfloat16")
            estimate = estimate_memory.estimate_step(config, layout)
            activations = estimate["activations_bytes"]
            if checkpointing:
                dims = estimate_memory.model_dimensions(config)
                coords = estimate_memory.rank_coordinates(layout)
                widths = estimate_memory.byte_widths(layout)
                activations += estimate_memory.activation_model(dims, layout, coords, widths)["layer_bytes"]
            cells.append(gigabytes(activations))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_04_measured_communication(runner):
    """Chapter 04: what rank 0 sent in one step of the memory figure's runs, next to the textbook volumes."""
    config = estimate_memory.load_config(REPO / "data" / "tiny-llama")
    parameters = estimate_memory.model_parameters(config)
    psi = 4 * sum(estimate_memory.numel(p.shape) for p in parameters)
    last_layer = max(p.layer for p in parameters if p.layer is not None)
    kept = 4 * sum(estimate_memory.numel(p.shape) for p in parameters if p.layer in (None, last_layer))
    lines = ["| ranks | chapter 02 (DDP): all-reduce | theory 2Ψ (N-1)/N | chapter 04 (FSDP): all-gather + "
             "reduce-scatter | theory (3Ψ - kept) (N-1)/N |", "| --- | --- | --- | --- | --- |"]
    for world_size in sorted({n for label, n in runner.measured if label == "DDP" and n > 1}):
        def sent(label, kinds):
            collectives = runner.measured[label, world_size]["steps"][0]["collectives"]
            return sum(c["sent_bytes"] for key, c in collectives.items() if key.split(" over ")[0] in kinds)

        fraction = (world_size - 1) / world_size
        lines.append(f"| {world_size} | {sent('DDP', ['all_reduce']) / 1e6:.2f} MB | {2 * psi * fraction / 1e6:.2f} MB | "
                     f"{sent('FSDP', ['all_gather', 'reduce_scatter']) / 1e6:.2f} MB | "
                     f"{(3 * psi - kept) * fraction / 1e6:.2f} MB |")
    return "\n".join(lines)


# Tables drawn from the runs of a full make_figures.py run: (README, the function that writes it from the runner).
MEASURED_TABLES = {
    "measured-communication": ("04-fully-sharded-data-parallel/README.md", table_04_measured_communication),
}
README_TABLES = {
    # marker name: (README, the function that writes the table)
    "zero-stages": ("04-fully-sharded-data-parallel/README.md", table_04_zero_stages),
    "405b-model-state": ("05-training-llama-405b/README.md", table_05_model_state),
    "405b-activations": ("05-training-llama-405b/README.md", table_05_activations),
}


def readme_tables(runner=None):
    """{README path: its text with every marked table as the estimator writes it now (and, given the runner of a
    full run, the tables drawn from its measurements)}."""
    texts = {}
    tables = {name: (readme, make_table) for name, (readme, make_table) in README_TABLES.items()}
    if runner is not None and runner.measured:
        # NOTE: only from a run that made the memory figure (not with --only parity, say).
        tables.update({name: (readme, lambda make=make_table: make(runner))
                       for name, (readme, make_table) in MEASURED_TABLES.items()})
    for name, (readme, make_table) in tables.items():
        path = REPO / readme
        text = texts.get(path, path.read_text())
        pattern = re.compile(rf"(<!-- table: {name}, written by dev/make_figures\.py -->\n)(.*?)(\n<!-- end of table -->)",
                             re.DOTALL)
        if not pattern.search(text):
            raise SystemExit(f"error: {readme} has no table marked {name!r}; put the table between "
                             f"'<!-- table: {name}, written by dev/make_figures.py -->' and '<!-- end of table -->'")
        table = make_table()
        texts[path] = pattern.sub(lambda match: match.group(1) + table + match.group(3), text)
    return texts


def write_readme_tables(runner=None):
    changed = []
    for path, text in readme_tables(runner).items():
        if path.read_text() != text:
            path.write_text(text)
            changed.append(str(path.relative_to(REPO)))
    return changed


# ---------------------------------------------------------------------------------------------------------------------
# The dry-run tables, from tools/dry_run.py beside tools/estimate_memory.py (--dry-runs; the tests check only that
# their estimate column is what the estimator computes now)

# marker name: (README, the layout as the table names it, tools/dry_run.py's arguments)
DRY_RUN_TABLES = {
    "dry-run-04-8b": ("04-fully-sharded-data-parallel/README.md", "Llama-3.1-8B, FSDP over 8 GPUs",
                      "04 --nnodes 1 --nproc-per-node 8 -m data/configs/llama-3.1-8b"),
    "dry-run-04-70b": ("04-fully-sharded-data-parallel/README.md", "Llama-3.1-70B, FSDP over 8 GPUs",
                       "04 --nnodes 1 --nproc-per-node 8 -m data/configs/llama-3.1-70b"),
    "dry-run-05-405b": ("05-training-llama-405b/README.md",
                        "Llama 3.1 405B, FSDP over 64 GPUs, 4,096 tokens, activation checkpointing, no CPU offload",
                        "05 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-405b --seq-length 4096 "
                        "--batch-size 1 --activation-checkpointing"),
    "dry-run-06-8b": ("06-tensor-parallel/README.md", "Llama-3.1-8B, TP 8 on one node",
                      "06 --nnodes 1 --nproc-per-node 8 -m data/configs/llama-3.1-8b"),
    "dry-run-07-8b": ("07-2d-parallel/README.md", "Llama-3.1-8B, 8 nodes, dp 8 x tp 8",
                      "07 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-8b --tp 8"),
    "dry-run-07-70b": ("07-2d-parallel/README.md", "Llama-3.1-70B, 4 nodes, dp 4 x tp 8",
                       "07 --nnodes 4 --nproc-per-node 8 -m data/configs/llama-3.1-70b --tp 8"),
    "dry-run-08-70b": ("08-pipeline-parallel/README.md",
                       "Llama-3.1-70B, 8 nodes, pp 8 x dp 8, 16 micro-batches of 1,024 tokens, the first stage",
                       "08 --nnodes 8 --nproc-per-node 8 -m data/configs/llama-3.1-70b --pp 8 --seq-length 1024 "
                       "--batch-size 16"),
    "dry-run-11-70b": ("11-4d-parallel/README.md", "Llama 3.1 70B, 4 nodes, tp 8 x pp 2 x dp 2, interleaved 1F1B, "
                       "4 micro-batches of 2,048 tokens",
                       "11 --nnodes 4 --nproc-per-node 8 -m data/configs/llama-3.1-70b --tp 8 --pp 2 --seq-length 2048 "
                       "--batch-size 4 --pp-schedule interleaved-1f1b"),
    "dry-run-11-405b": ("11-4d-parallel/README.md", "Llama 3.1 405B, 64 nodes, tp 8 x pp 8 x cp 4 x dp 2, interleaved "
                        "1F1B, 8 micro-batches of 8,192 tokens",
                        "11 --nnodes 64 --nproc-per-node 8 -m data/configs/llama-3.1-405b --tp 8 --pp 8 --cp 4 "
                        "--seq-length 8192 --batch-size 8 --pp-schedule interleaved-1f1b"),
    "dry-run-09-8b": ("09-context-parallel/README.md", "Llama-3.1-8B, one node, cp 8, 32,768 tokens",
                      "09 --nnodes 1 --nproc-per-node 8 -m data/configs/llama-3.1-8b --cp 8 --seq-length 32768 "
                      "--batch-size 1"),
}
DRY_RUN_ROWS = ["parameters", "gradients", "optimizer state", "activations at the peak", "the rest at the peak", "peak"]


def dry_run_layout(arguments):
    """(chapter, its arguments, nproc per node, world size) of a dry_run.py command line, with its default dtype."""
    words = arguments.split()
    chapter, nnodes, nproc = words[0], int(words[words.index("--nnodes") + 1]), int(words[words.index("--nproc-per-node") + 1])
    chapter_args = [word for index, word in enumerate(words[1:], 1)
                    if word not in ("--nnodes", "--nproc-per-node") and words[index - 1] not in ("--nnodes", "--nproc-per-node")]
    return chapter, [*chapter_args, "--dtype", "bfloat16"], nproc, nnodes * nproc


def dry_run_estimate(arguments):
    """{row: bytes}: tools/estimate_memory.py's side of tools/dry_run.py's comparison, computed now."""
    import dry_run

    chapter, chapter_args, nproc, world_size = dry_run_layout(arguments)
    result = {"held": {}, "peak": {"Total": 0}, "step_counter_bytes": 0,
              "estimate": dry_run.estimate(chapter, chapter_args, 0, nproc, world_size)}
    return {row: estimated for row, _, estimated in dry_run.compare(result)}


def run_dry_run(arguments, work_dir, reuse):
    """tools/dry_run.py's --json result for rank 0 (kept in work_dir/dry-runs/, reused with --reuse)."""
    out = work_dir / "dry-runs" / (re.sub(r"[^\w.-]+", "_", arguments) + ".json")
    if not (reuse and out.exists()):
        out.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        result = subprocess.run([sys.executable, str(TOOLS / "dry_run.py"), *arguments.split(), "--json"], cwd=REPO,
                                capture_output=True, text=True, timeout=3 * 3600)
        if result.returncode != 0:
            raise SystemExit(f"error: tools/dry_run.py {arguments} failed: {result.stderr.strip().splitlines()[-1:]}")
        # NOTE: the chapter's own log lines come first; the JSON starts at the last line that is "{".
        out.write_text(result.stdout[("\n" + result.stdout).rindex("\n{\n"):])
        print(f"dry run {arguments}: {time.perf_counter() - started:.0f}s", flush=True)
    return json.loads(out.read_text())


def dry_run_table(layout, arguments, result):
    import dry_run

    lines = [f"| {layout}, rank 0, per GPU | estimate | dry run | difference |", "| --- | --- | --- | --- |"]
    for row, measured, estimated in dry_run.compare(result):
        difference = "equal" if measured == estimated else f"{measured / estimated - 1:+.1%}" if estimated else ""
        lines.append(f"| {row} | {dry_gigabytes(estimated)} | {dry_gigabytes(measured)} | {difference} |")
    lines.append(f"\nDry run on the CPU, fake process group and FakeTensorMode (`python tools/dry_run.py {arguments}`, "
                 f"{result['cpu_seconds']:.0f} s of CPU); the estimate is tools/estimate_memory.py's for the same "
                 f"layout.")
    return "\n".join(lines)


def dry_gigabytes(value):
    return f"{value / 1e9:,.2f} GB"


def dry_run_block(name):
    return re.compile(rf"(<!-- table: {name}, written by dev/make_figures\.py -->\n)(.*?)(\n<!-- end of table -->)",
                      re.DOTALL)


def write_dry_run_tables(work_dir, reuse):
    changed = []
    for name, (readme, layout, arguments) in DRY_RUN_TABLES.items():
        path = REPO / readme
        if not dry_run_block(name).search(path.read_text()):
            raise SystemExit(f"error: {readme} has no table marked {name!r}; put the table between "
                             f"'<!-- table: {name}, written by dev/make_figures.py -->' and '<!-- end of table -->'")
        table = dry_run_table(layout, arguments, run_dry_run(arguments, work_dir, reuse))
        text = path.read_text()
        new = dry_run_block(name).sub(lambda match: match.group(1) + table + match.group(3), text)
        if new != text:
            path.write_text(new)
            changed.append(f"{readme} ({name})")
    return changed


if __name__ == "__main__":
    main()
