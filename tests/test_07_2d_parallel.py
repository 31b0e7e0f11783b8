"""Chapter 07: tensor parallel inside, FSDP across, on one device mesh. CPU processes under torchrun (gloo) train
exactly as chapter 01 does with the same global batch, whatever the layout of 2 or 4 ranks (dp x tp, and hybrid
sharding), a model with tied embeddings included; resume is exact, and a checkpoint resumes at another
data-parallel size; a layout that does not fit the world gets a one-line error; tokens/s counts the data-parallel
ranks only; the README's commands are layouts tested here (tests/test_repo.py checks that its excerpts are the script's
lines).

`pytest -s` prints the figures: the largest loss and weight differences from chapter 01, and after a resume.
Every run trains 6 steps of 4 sequences of 64 tokens: 4 processes on 2 cores take a few seconds per step.
"""

import shlex
import shutil

import pytest

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, MATRIX_ARGS, MATRIX_LAYOUTS, NO_CLIPPING, REPO, checkpoint_weights,
                     error_lines, grad_norm_difference, logged_parameter_count, matrix_job, max_difference,
                     read_losses, read_metrics, readme_experiment, train, without_experiment, check_family_matrix)

README = REPO / CHAPTERS["07"] / "README.md"
STEPS, HALF = 6, 3
COMMON = ["--max-steps", str(STEPS), "--wandb-mode", "disabled"]
GLOBAL_BATCH = 4
SEQ_LENGTH = 64  # FAST_ARGS' --seq-length
FINAL_CHECKPOINT = f"checkpoint-{STEPS:08d}"

# The layout flags, as the README writes them, and the mesh they must give. Each case gets chapter 01's global batch
# of 4 sequences: --batch-size is 4 / the data-parallel size (every dimension but tp).
LAYOUTS = {
    "dp2-tp2": (["--tp", "2"], {"dp": 2, "tp": 2}),
    "dp1-tp2": (["--tp", "2"], {"dp": 1, "tp": 2}),
    "dp2-tp1": (["--tp", "1"], {"dp": 2, "tp": 1}),
    # Hybrid sharding with the CPU's default --tp 1: FSDP shards within ranks {0, 1} and within {2, 3}, and the
    # two groups all-reduce their gradients.
    "hsdp-replicate2-shard2": (["--dp-replicate", "2"], {"dp_replicate": 2, "dp_shard": 2, "tp": 1}),
    # The replicas' all-reduce held for the step's last micro-batch (set_requires_all_reduce).
    "hsdp-replicate2-accum2": (["--dp-replicate", "2", "--grad-accum", "2"],
                               {"dp_replicate": 2, "dp_shard": 1, "tp": 1}),
}


def layout(case):
    """(processes, data-parallel size, the run's flags) of a layout."""
    flags, mesh = LAYOUTS[case]
    nproc = dp_size = 1
    for name, size in mesh.items():
        nproc *= size
        dp_size *= 1 if name == "tp" else size
    grad_accum = int(flags[flags.index("--grad-accum") + 1]) if "--grad-accum" in flags else 1
    return nproc, dp_size, [*flags, "--batch-size", str(GLOBAL_BATCH // (dp_size * grad_accum))]


def reference_run(runs, env, *clipping):
    return runs.train("01", env, *COMMON, "--batch-size", str(GLOBAL_BATCH), *clipping)


def layout_run(runs, env, case, *clipping):
    nproc, _, flags = layout(case)
    return runs.train("07", env, *COMMON, *flags, *clipping, nproc=nproc)


def interrupted_run(runs, env):
    """dp 2 x tp 1, stopped after step 3 of 6: the experiment holds checkpoint-00000003 and the metrics of 1-3."""
    _, _, flags = layout("dp2-tp1")
    return runs.train("07", env, *COMMON, *flags, "--exit-after-steps", str(HALF), nproc=2)


def largest_weight_difference(checkpoint_a, checkpoint_b, scratch_dir):
    weights_a, weights_b = checkpoint_weights(checkpoint_a, scratch_dir), checkpoint_weights(checkpoint_b, scratch_dir)
    assert weights_a.keys() == weights_b.keys(), sorted(weights_a.keys() ^ weights_b.keys())
    return max((weights_a[name] - weights_b[name]).abs().max().item() for name in weights_a)


# Clipping at 1.0 binds at every step, except in the one case with NO_CLIPPING (FSDP and TP both at work).
@pytest.mark.parametrize("case, clipping", [*(pytest.param(case, [], marks=[pytest.mark.quick] * (case == "dp1-tp2"))
                                               for case in LAYOUTS), ("dp2-tp2", NO_CLIPPING)],
                         ids=[*LAYOUTS, "dp2-tp2-unclipped"])
def test_every_layout_matches_one_process_with_the_same_global_batch(env, runs, tmp_path, case, clipping):
    _, reference = reference_run(runs, env, *clipping)
    result, experiment = layout_run(runs, env, case, *clipping)
    losses = read_losses(experiment)
    assert len(losses) == STEPS
    loss_difference = max_difference(read_losses(reference), losses)
    weight_difference = largest_weight_difference(reference / FINAL_CHECKPOINT, experiment / FINAL_CHECKPOINT,
                                                  tmp_path)
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping)
    print(f"\nparity {case}{' unclipped' if clipping else ''} vs chapter 01: largest loss difference "
          f"{loss_difference:.1e}, largest weight difference {weight_difference:.1e}, relative gradient norm "
          f"difference {norm_difference:.1e} after {STEPS} steps")
    assert f"device mesh: {LAYOUTS[case][1]}" in result.stdout
    # fp32 on the CPU: only the order of the floating-point sums differs (slices, shards, all-reduces).
    assert loss_difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    # AdamW divides by the root of the squared gradients, so a weight whose gradient is ~0 (a rare token's
    # embedding row) moves by ~lr whatever the sign of its rounding noise: weights agree less closely than losses.
    # NOTE: unclipped (gradients 2-6x the clipped ones, against AdamW's eps) such weights moved further: measured
    # 4.6e-4 at dp 2 x tp 2; bound: one step of the peak lr, 1e-3.
    assert weight_difference <= (1e-3 if clipping else 2e-4)


def test_a_tied_model_trains_one_matrix_as_chapter_01_does(env, runs, tmp_path, tied_model):
    """dp 2 x tp 2 on the tiny model with tie_word_embeddings true: parallelize_model() gives the head the
    embedding's DTensor back, and FSDP's root group shards that one parameter along dp. Left untied, the head
    would start from weights of its own and train apart, a vocabulary x hidden matrix more than chapter 01 has."""
    reference_result, reference = runs.train("01", env, "-m", tied_model, *COMMON, "--batch-size", str(GLOBAL_BATCH))
    nproc, _, flags = layout("dp2-tp2")
    result, experiment = runs.train("07", env, "-m", tied_model, *COMMON, *flags, nproc=nproc)
    loss_difference = max_difference(read_losses(reference), read_losses(experiment))
    weight_difference = largest_weight_difference(reference / FINAL_CHECKPOINT, experiment / FINAL_CHECKPOINT,
                                                  tmp_path)
    weights = checkpoint_weights(experiment / FINAL_CHECKPOINT, tmp_path)
    head_vs_embedding = (weights["lm_head.weight"] - weights["model.embed_tokens.weight"]).abs().max().item()
    print(f"\ntied model, dp2-tp2 vs chapter 01: largest loss difference {loss_difference:.1e}, largest weight "
          f"difference {weight_difference:.1e} after {STEPS} steps; parameters {logged_parameter_count(result)} vs "
          f"{logged_parameter_count(reference_result)}; checkpoint's head vs embedding: {head_vs_embedding:.1e}")
    assert loss_difference <= 1e-5
    assert weight_difference <= 2e-4
    assert logged_parameter_count(result) == logged_parameter_count(reference_result)
    assert head_vs_embedding == 0


@pytest.mark.parametrize("case", ["dp2-tp1", "dp1-tp2"])
def test_resume_continues_the_loss_curve_at_the_same_or_another_layout(env, runs, tmp_path, case):
    """Saved at dp 2 x tp 1 after step 3; resumed on the same layout (exact), or on dp 1 x tp 2 with the same global
    batch: DCP cuts each weight and AdamW moment into the new layout's slices, and the data position is a count
    of global samples, so steps 4-6 see the samples, and the weights, of the uninterrupted run."""
    _, straight = layout_run(runs, env, "dp2-tp1")
    _, interrupted = interrupted_run(runs, env)
    assert [path.name for path in interrupted.glob("checkpoint-*")] == [f"checkpoint-{HALF:08d}"]
    shutil.copytree(interrupted, tmp_path / "outputs" / "resumed")
    nproc, _, flags = layout(case)
    result, resumed = train("07", env, tmp_path, *COMMON, *flags, nproc=nproc, experiment="resumed")
    assert f"checkpoint-{HALF:08d} at step {HALF}" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    weight_difference = largest_weight_difference(straight / FINAL_CHECKPOINT, resumed / FINAL_CHECKPOINT, tmp_path)
    print(f"\nresume dp2-tp1 -> {case}: {STEPS} steps straight vs {HALF} + {STEPS - HALF}: largest loss difference "
          f"{loss_difference:.1e}, largest weight difference {weight_difference:.1e}")
    norm_difference = grad_norm_difference(straight, resumed, clipped=True)
    if case == "dp2-tp1":
        assert loss_difference <= 1e-6
        assert weight_difference == 0.0
        assert norm_difference <= 1e-6
    else:
        assert loss_difference <= 1e-5
        assert weight_difference <= 2e-4
        assert norm_difference <= GRAD_NORM_TOLERANCE


BAD_LAYOUTS = {
    "tp larger than the world": (["--tp", "4"], "error: --tp 4 does not divide the world size 2; use a divisor of 2"),
    "dp-replicate not dividing dp": (["--tp", "1", "--dp-replicate", "3"],
                                     "error: --dp-replicate 3 does not divide the data-parallel degree 2 "
                                     "(world size 2 / --tp 1)"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_a_layout_that_does_not_fit_the_world_gets_a_one_line_error(env, tmp_path, case):
    flags, expected = BAD_LAYOUTS[case]
    result, _ = train("07", env, tmp_path, *COMMON, *flags, nproc=2, check=False, timeout=180)
    assert result.returncode == 1
    # NOTE: each rank checks the layout on its own, rank 1 after rank 0 (rank_zero_first loads the config): the first
    # to stop prints the line, and torchrun then stops the others, which on a loaded machine may not have printed yet.
    errors = error_lines(result.stderr)
    assert 1 <= len(errors) <= 2 and all(line.startswith(expected) for line in errors), result.stderr[-3000:]
    assert "train_llm.py\", line" not in result.stderr, "a rank printed a traceback"


def test_readme_cpu_commands_are_layouts_tested_here():
    """The README's torchrun commands for the CPU are layouts the parity test runs (with FAST_ARGS and the batch size
    added, from a scratch folder), so they work as written."""
    commands = [shlex.split(line.strip()) for line in README.read_text().splitlines()
                if line.strip().startswith("torchrun --standalone ")]
    tested = [["torchrun", "--standalone", "--nproc-per-node", str(layout(case)[0]), f"{CHAPTERS['07']}/train_llm.py",
               *LAYOUTS[case][0]] for case in LAYOUTS]
    assert commands, f"no 'torchrun --standalone ...' command in {README}"
    assert all(without_experiment(command) in tested for command in commands), commands
    # NOTE: each its own experiment: a later one would resume an earlier one's finished run and train nothing
    assert len({readme_experiment(command, "07") for command in commands}) == len(commands)
    layouts = [without_experiment(command) for command in commands]
    hybrid = tested[list(LAYOUTS).index("hsdp-replicate2-shard2")]
    assert tested[0] in layouts and hybrid in layouts, "the README shows dp 2 x tp 2 and hybrid sharding"


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("07", runs, env, family_models)


def test_pretrained_weights_load_into_hybrid_shards(runs, env, family_models):
    """The matrix's pretrained Llama at --dp-replicate 2 (a (replicate, shard) mesh: every weight a DTensor
    Replicate x Shard(0)), on the matrix's global batch: its first loss is chapter 05's from the same folder."""
    _, batch_size_flags = MATRIX_LAYOUTS["05"]
    result, experiment = runs.train("07", env, *MATRIX_ARGS, "-d", family_models["corpus"], "-m",
                                    family_models["pretrained"], "--max-steps", "1", "--dp-replicate", "2",
                                    *batch_size_flags[:2], nproc=2)
    expected = matrix_job(runs, env, "05", family_models)["pretrained"][0]["loss"]
    first = read_metrics(experiment)[0]["loss"]
    print(f"\npretrained at --dp-replicate 2: first loss {first:.6f}, chapter 05's {expected:.6f}")
    assert f"loaded the pretrained weights of {family_models['pretrained']}" in result.stdout
    assert abs(first - expected) <= 1e-5
