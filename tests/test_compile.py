"""Chapters 04 to 11 with --compile --activation-checkpointing: each trains as chapter 01 does (fp32 on the CPU:
losses within 1e-4, gradient norms within 1e-3 relative), with a graph per layer and no graph break (every layer
compiles with fullgraph=True, so a break would stop the run), and chapters 04 and 11 resume exactly.

On the CPU inductor compiles C++ for each graph (tens of seconds on 2 cores): the chapters compile with aot_eager
(dynamo and AOT autograd, the same graphs without inductor's code generation; tests/faults' COMPILE_BACKEND), and
inductor runs in 05 (its layer compiled whole, as in 04 and 06-08; the suite's time budget leaves the other
chapters to aot_eager). One job of
tests/many_runs.py per chapter runs its uninterrupted run, then (04 and 11) a run stopped after step 3 and its
resumption. The tiny Llama of the family matrix (tests/helpers.py), on the first 15 texts of the corpus.
"""

import pytest

from helpers import (FAMILIES, GRAD_NORM_TOLERANCE, MANY_RUNS, family_folder_name, read_metrics, torchrun,
                     with_faults)

STEPS, HALF = 6, 3
ARGS = ["--seq-length", "32", "--max-steps", str(STEPS), "--wandb-mode", "disabled"]
FLAGS = ["--compile", "--activation-checkpointing"]
# chapter: (processes, the layout's flags, the family, the backend, whether it resumes); a global batch of 4.
CASES = {
    "04": (2, ["--batch-size", "2"], "Llama", "aot_eager", True),
    "05": (2, ["--batch-size", "2", "--eval-fraction", "0"], "Llama", "inductor", False),
    "06": (2, ["--batch-size", "4"], "Llama", "aot_eager", False),
    "07": (2, ["--tp", "2", "--batch-size", "4"], "Llama", "aot_eager", False),
    "08": (2, ["--pp", "2", "--batch-size", "4"], "Llama", "aot_eager", False),
    "09": (2, ["--cp", "2", "--batch-size", "4"], "Llama", "aot_eager", False),
    "10": (2, ["--ep", "2", "--batch-size", "2"], "Mixtral (MoE)", "aot_eager", False),
    "11": (4, ["--pp", "2", "--cp", "2", "--batch-size", "4"], "Llama", "aot_eager", True),
}


def compiled_job(runs, env, chapter, family_models):
    """The chapter's compiled runs in one job: {"straight": metrics, "resumed": metrics or None, "counts": lines}."""
    import json
    import re

    nproc, flags, family, backend, resumes = CASES[chapter]
    experiment = f"compiled-{chapter}"
    job = [["-e", f"{experiment}-straight"]]
    if resumes:
        job += [["-e", f"{experiment}-resumed", "--exit-after-steps", str(HALF)], ["-e", f"{experiment}-resumed"]]
    runs_file = runs.workdir / f"{experiment}.json"
    runs_file.write_text(json.dumps(job))
    result, _ = runs.train(chapter, with_faults(env, COMPILE_BACKEND=backend), *ARGS, *flags, *FLAGS, "-m",
                           family_models[family], "-d", family_models["corpus"], nproc=nproc,
                           launcher=[*torchrun(nproc), MANY_RUNS, runs_file])
    outputs = runs.workdir / "outputs"
    return {"straight": read_metrics(outputs / f"{experiment}-straight"),
            "resumed": read_metrics(outputs / f"{experiment}-resumed") if resumes else None,
            "exits": re.findall(r"\[rank \d+\] run \d+: (exit \d+)", result.stdout),
            "graphs": re.findall(r"\[rank \d+\] run 0: graphs (\d+), breaks (\d+)", result.stdout)}


@pytest.mark.parametrize("chapter", CASES)
def test_compiled_checkpointed_layers_train_as_chapter_01_and_resume_exactly(runs, env, family_models, chapter):
    nproc, _, family, backend, resumes = CASES[chapter]
    _, reference = runs.train("01", env, *ARGS, "--batch-size", "4", "-m", family_models[family], "-d",
                              family_models["corpus"])
    expected, job = read_metrics(reference), compiled_job(runs, env, chapter, family_models)
    straight = job["straight"]
    losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(straight, expected))
    norms = max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(straight, expected))
    print(f"\n{chapter} compiled ({backend}) with activation checkpointing vs chapter 01: losses {losses:.1e}, "
          f"gradient norms {norms:.1e}; dynamo's graphs and breaks per rank: {job['graphs']}")
    assert set(job["exits"]) == {"exit 0"}, job["exits"]
    assert len(straight) == len(expected) == STEPS and losses <= 1e-4 and norms <= 1e-3
    # The positive control: each rank compiled graphs (one for all layers, and their recompilations), none broken.
    assert len(job["graphs"]) == nproc and all(int(graphs) >= 1 and breaks == "0" for graphs, breaks in job["graphs"])
    if resumes:
        # The resumed run's steps are the uninterrupted run's, exactly.
        assert [(record["loss"], record["grad_norm"]) for record in job["resumed"]] == \
               [(record["loss"], record["grad_norm"]) for record in straight]
