"""Plot the metrics.jsonl of any number of experiments: loss, learning rate, tokens/s and memory, step by step, and
how far each run's loss is from the first one's.

    python tools/plot_runs.py outputs/parity-1 outputs/parity-2 -o parity.png
    python tools/plot_runs.py outputs/01-single-gpu --metrics loss lr -o loss.svg

Each argument is an experiment folder (or a metrics.jsonl file). A step logged twice (a resumed run logs the steps
since its last checkpoint again) counts with its last record, as the training scripts' own readers do. The output
format follows the file name: .png or .svg (or anything else matplotlib writes).
"""

import argparse
import json
import sys
from pathlib import Path

# NOTE: the panels a figure can have, with the metrics.jsonl fields each one draws. "memory" takes whichever the
# run logged: the CUDA peaks (allocated, reserved) or, on the CPU, the process's peak resident memory.
PANELS = {
    "loss": {"fields": ["loss"], "ylabel": "loss"},
    "difference": {"fields": ["loss"], "ylabel": "|loss - first run's loss|"},
    "lr": {"fields": ["lr"], "ylabel": "learning rate"},
    "grad_norm": {"fields": ["grad_norm"], "ylabel": "gradient norm (before clipping)"},
    "tokens_per_second": {"fields": ["tokens_per_second"], "ylabel": "tokens/s"},
    "memory": {"fields": ["memory_allocated_gb", "memory_reserved_gb", "memory_rss_gb"], "ylabel": "peak memory (GB)"},
}
DEFAULT_PANELS = ["loss", "difference", "lr", "tokens_per_second", "memory"]


def main():
    parser = argparse.ArgumentParser(
        description="Plot loss, learning rate, tokens/s and memory from the metrics.jsonl of experiment folders, "
                    "with a panel of each run's loss difference to the first run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="experiment folders (outputs/NAME) or metrics.jsonl files")
    parser.add_argument("-o", "--output", default="runs.png", help="the figure file: .png or .svg")
    parser.add_argument("--labels", nargs="+", metavar="LABEL", help="a legend label per run (default: folder names)")
    parser.add_argument("--metrics", nargs="+", choices=list(PANELS), default=DEFAULT_PANELS, metavar="PANEL",
                        help=f"the panels, in order, of {', '.join(PANELS)} ('difference' needs two runs or more)")
    parser.add_argument("--title", default=None, help="a title above the panels")
    parser.add_argument("--dpi", type=int, default=110, help="resolution of a PNG")
    args = parser.parse_args()
    if Path(args.output).suffix.lower() not in (".png", ".svg"):
        fail(f"-o {args.output}: write a .png or a .svg")
    if args.labels and len(args.labels) != len(args.runs):
        fail(f"{len(args.labels)} --labels for {len(args.runs)} runs; give one label per run")
    runs = [(label, read_metrics(path)) for label, path in zip(args.labels or [run_name(p) for p in args.runs],
                                                                 args.runs)]
    panels = [panel for panel in args.metrics if panel != "difference" or len(runs) > 1]
    figure = plot_runs(runs, panels, title=args.title)
    save_figure(figure, args.output, args.dpi)
    print(f"wrote {args.output}")


def fail(message):
    raise SystemExit(f"error: {message}")


def run_name(path):
    path = Path(path)
    return path.parent.name if path.name == "metrics.jsonl" else path.name


def read_metrics(path):
    """The last record logged for each step of an experiment folder or metrics.jsonl file, in step order."""
    path = Path(path)
    metrics_file = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics_file.is_file():
        fail(f"no metrics file at {metrics_file}; give an experiment folder (e.g. outputs/01-single-gpu) or a "
             "metrics.jsonl file")
    records = {}
    for number, line in enumerate(metrics_file.read_text().splitlines(), 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                fail(f"{metrics_file} line {number} is not JSON; is it a metrics.jsonl of train_llm.py?")
            records[record["step"]] = record
    if not records:
        fail(f"{metrics_file} holds no records yet")
    return [records[step] for step in sorted(records)]


def plot_runs(runs, panels, title=None, width=7.0, panel_height=2.3):
    """A figure with one panel per name in panels, one line per (label, records) run, sharing the step axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(panels), 1, figsize=(width, panel_height * len(panels) + 0.4), sharex=True,
                                squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "difference":
            draw_differences(ax, runs)
        else:
            draw_panel(ax, runs, PANELS[panel]["fields"])
        ax.set_ylabel(PANELS[panel]["ylabel"])
        ax.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    if title:
        figure.suptitle(title, fontsize="medium")
    figure.tight_layout()
    return figure


def draw_panel(ax, runs, fields):
    styles = line_styles(len(runs))
    for (label, records), style in zip(runs, styles):
        logged = [field for field in fields if any(r.get(field) is not None for r in records)]
        for field in logged:
            points = [(r["step"], r[field]) for r in records if r.get(field) is not None]
            suffix = "" if len(logged) == 1 else f" ({field.removeprefix('memory_').removesuffix('_gb')})"
            ax.plot(*zip(*points), label=label + suffix, **style)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small", loc="best")


def draw_differences(ax, runs):
    """|loss - first run's loss| at every step both logged, on a log scale; exact agreement is drawn on the axis."""
    _, first = runs[0]
    first_loss = {r["step"]: r["loss"] for r in first}
    styles = line_styles(len(runs))[1:]
    for (label, records), style in zip(runs[1:], styles):
        points = [(r["step"], abs(r["loss"] - first_loss[r["step"]])) for r in records if r["step"] in first_loss]
        equal = sum(1 for _, d in points if d == 0)
        ax.plot([s for s, _ in points], [d if d > 0 else float("nan") for _, d in points],
                label=label + (f" ({equal} steps equal)" if equal else ""), **style)
    ax.set_yscale("log")
    ax.legend(fontsize="small", loc="best")
    ax.set_title(f"loss difference to {runs[0][0]}", fontsize="medium")


def line_styles(count):
    """Distinct colours, and markers that keep overlapping lines visible: equal curves lie on top of each other."""
    markers = ["o", "s", "^", "v", "D", "x", "+", "*"]
    return [{"color": f"C{i % 10}", "marker": markers[i % len(markers)], "markersize": max(2.5, 6.0 - 0.7 * i),
             "linewidth": 1.2, "markevery": 0.05, "alpha": 0.85} for i in range(count)]


def save_figure(figure, output, dpi=110):
    import matplotlib.pyplot as plt

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=dpi, metadata=stable_metadata(output))
    plt.close(figure)


def stable_metadata(output):
    """No creation date or software version in the file: the same figure writes the same bytes."""
    suffix = Path(output).suffix.lower()
    if suffix == ".png":
        return {"Software": None}
    if suffix == ".svg":
        return {"Date": None, "Creator": None}
    if suffix == ".pdf":
        return {"CreationDate": None, "Producer": None, "Creator": None}
    return None


if __name__ == "__main__":
    sys.exit(main())
