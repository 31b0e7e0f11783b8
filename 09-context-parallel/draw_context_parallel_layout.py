"""Draw chapter 09's picture of causal load balancing: which rank computes which part of the attention matrix.

    python 09-context-parallel/draw_context_parallel_layout.py     # writes 09-context-parallel/load-balanced-layout.png
    python 09-context-parallel/draw_context_parallel_layout.py --out layout.png

The sequence of one example is cut into 2 x cp chunks (cp = 4: 8 chunks). Each cell of the grid is a chunk of
queries (row) against a chunk of keys (column); the causal mask leaves the cells on and below the diagonal (a cell
on the diagonal is half a block). A cell is coloured by the rank that holds its queries, which is the rank that
computes it. The layout comes from the chapter's own get_token_indices(); the bars count each rank's cells.
"""

import argparse
import importlib.util
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend that needs no display)

CHAPTER_DIR = Path(__file__).resolve().parent
OUTPUT = CHAPTER_DIR / "load-balanced-layout.png"
CP = 4
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]


def main():
    parser = argparse.ArgumentParser(description="Draw chapter 09's picture of causal load balancing.")
    parser.add_argument("--out", type=Path, default=OUTPUT, help="the PNG to write (default: the chapter's)")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("train_llm_09", CHAPTER_DIR / "train_llm.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    chunks = 2 * CP
    figure, axes = plt.subplots(2, 2, figsize=(8.4, 6.4), gridspec_kw={"height_ratios": [3, 1]})
    for column, load_balance in enumerate([False, True]):
        # NOTE: one token per chunk is enough to read the layout: chunk c is token c of a sequence of 2 x cp.
        owner = {}
        for rank in range(CP):
            for chunk in chapter.get_token_indices(chunks, rank, CP, load_balance, "cpu").tolist():
                owner[chunk] = rank
        grid, work = axes[0][column], [0.0] * CP
        for query in range(chunks):
            for key in range(query + 1):
                rank = owner[query]
                share = 0.5 if key == query else 1.0
                work[rank] += share
                triangle = key == query
                xs = [key, key + 1, key + 1, key] if not triangle else [key, key + 1, key]
                ys = [query, query, query + 1, query + 1] if not triangle else [query, query + 1, query + 1]
                grid.fill(xs, ys, color=COLORS[rank], edgecolor="white", linewidth=1.5)
        grid.set_xlim(0, chunks)
        grid.set_ylim(chunks, 0)
        grid.set_aspect("equal")
        grid.set_xticks([index + 0.5 for index in range(chunks)], [str(index) for index in range(chunks)])
        grid.set_yticks([index + 0.5 for index in range(chunks)], [f"{index} (rank {owner[index]})"
                                                                    for index in range(chunks)])
        grid.set_xlabel("key chunk")
        grid.set_ylabel("query chunk (held by)")
        grid.set_title("load balancing on: rank i holds chunks i, 7 - i" if load_balance
                       else "load balancing off: rank i holds chunks 2i, 2i + 1", fontsize=10)
        bars = axes[1][column]
        bars.bar([f"rank {rank}" for rank in range(CP)], work, color=COLORS)
        bars.set_ylabel("chunk pairs computed")
        bars.set_ylim(0, 16)
        for rank, blocks in enumerate(work):
            bars.text(rank, blocks + 0.3, f"{blocks:g}", ha="center", fontsize=9)
    figure.suptitle(f"Causal attention over one sequence in {chunks} chunks, split across {CP} context-parallel ranks",
                    fontsize=11)
    figure.tight_layout()
    figure.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
