"""Chapter 11: FSDP, tensor, pipeline and context parallelism on one (dp, pp, cp, tp) mesh. CPU processes under
torchrun (gloo) train exactly as chapter 01 does with the same global batch in five layouts of 4 and 8 ranks that
compose two or three of the four; resume is exact; a checkpoint of tp 2 x pp 2 x dp 2 resumes as chapter 04's plain
FSDP and as chapter 07's tp 2 x dp 2 and continues the curve; a layout that cannot be made gets a one-line error;
the README's CPU commands are layouts tested here.

`pytest -s` prints the figures. Every run trains 6 steps of a global batch of 4 sequences of 64 tokens (FAST_ARGS'
--seq-length: divisible by 2 x cp for load balancing, and by tp after the cp split).
"""

import shlex
import shutil
import signal

import pytest

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, NO_CLIPPING, REPO, checkpoint_weights, error_lines,
                     grad_norm_difference, logged_step, max_difference, read_losses, read_metrics, readme_experiment,
                     train, train_until_signalled, without_experiment, check_family_matrix)
from helpers import quick_cases

README = REPO / CHAPTERS["11"] / "README.md"
STEPS, HALF = 6, 3
COMMON = ["--max-steps", str(STEPS), "--wandb-mode", "disabled"]
GLOBAL_BATCH = 4
FINAL_CHECKPOINT = f"checkpoint-{STEPS:08d}"

# The layout flags, as the README writes them, and the mesh they must give; --batch-size is 4 / dp / --grad-accum.
# Clipping at 1.0 binds at every step (chapter 01's norms are 1.9 to 5.8), except in the cases with NO_CLIPPING.
LAYOUTS = {
    "tp2-pp2-dp2": (["--tp", "2", "--pp", "2"], {"dp": 2, "pp": 2, "cp": 1, "tp": 2}),
    "tp2-cp2-dp2": (["--tp", "2", "--cp", "2"], {"dp": 2, "pp": 1, "cp": 2, "tp": 2}),
    "pp2-cp2-tp2": (["--tp", "2", "--pp", "2", "--cp", "2"], {"dp": 1, "pp": 2, "cp": 2, "tp": 2}),
    "tp2-pp2": (["--tp", "2", "--pp", "2"], {"dp": 1, "pp": 2, "cp": 1, "tp": 2}),
    "pp2-cp2": (["--pp", "2", "--cp", "2"], {"dp": 1, "pp": 2, "cp": 2, "tp": 1}),
    # NOTE: two batches of 2 a step, run as one schedule of 4 micro-batches (one fill and drain).
    "pp2-cp2-unclipped-accum2": (["--pp", "2", "--cp", "2", "--grad-accum", "2", *NO_CLIPPING],
                                 {"dp": 1, "pp": 2, "cp": 2, "tp": 1}),
    # NOTE: --global-batch-size divides by the 2 data-parallel ranks (not the world's 4): one micro-step. ZBV (a
    # rank's stages in a V, each backward split in two) needs the reduction once a step.
    "pp2-dp2-zbv-reduce-per-step": (["--pp", "2", "--pp-schedule", "zbv", "--pp-grad-reduce", "step",
                                     "--global-batch-size", str(GLOBAL_BATCH)], {"dp": 2, "pp": 2, "cp": 1, "tp": 1}),
    # NOTE: at --pp 1 the interleaved schedule still runs a rank's two stages in turn.
    "interleaved-pp1-dp2": (["--pp-schedule", "interleaved-1f1b"], {"dp": 2, "pp": 1, "cp": 1, "tp": 1}),
}


def layout(case):
    """(processes, the run's flags) of a layout: --batch-size is the global batch over dp and --grad-accum."""
    flags, mesh = LAYOUTS[case]
    nproc = mesh["dp"] * mesh["pp"] * mesh["cp"] * mesh["tp"]
    accumulation = int(flags[flags.index("--grad-accum") + 1]) if "--grad-accum" in flags else 1
    return nproc, [*flags, "--batch-size", str(GLOBAL_BATCH // mesh["dp"] // accumulation)]


def clipping(case):
    return NO_CLIPPING if NO_CLIPPING[0] in LAYOUTS[case][0] else []


def reference_run(runs, env, *clipping_flags):
    return runs.train("01", env, *COMMON, "--batch-size", str(GLOBAL_BATCH), *clipping_flags)


def layout_run(runs, env, case):
    nproc, flags = layout(case)
    return runs.train("11", env, *COMMON, *flags, nproc=nproc)


def interrupted_run(runs, env):
    """tp 2 x pp 2 x dp 2, stopped after step 3 of 6: the experiment holds checkpoint-00000003 and steps 1-3."""
    nproc, flags = layout("tp2-pp2-dp2")
    return runs.train("11", env, *COMMON, *flags, "--exit-after-steps", str(HALF), nproc=nproc)


def largest_weight_difference(checkpoint_a, checkpoint_b, scratch_dir):
    weights_a, weights_b = checkpoint_weights(checkpoint_a, scratch_dir), checkpoint_weights(checkpoint_b, scratch_dir)
    assert weights_a.keys() == weights_b.keys(), sorted(weights_a.keys() ^ weights_b.keys())
    return max((weights_a[name] - weights_b[name]).abs().max().item() for name in weights_a)


@pytest.mark.parametrize("case", quick_cases(LAYOUTS, "tp2-pp2"))
def test_every_layout_matches_one_process_with_the_same_global_batch(env, runs, tmp_path, case):
    _, reference = reference_run(runs, env, *clipping(case))
    result, experiment = layout_run(runs, env, case)
    losses = read_losses(experiment)
    assert len(losses) == STEPS
    loss_difference = max_difference(read_losses(reference), losses)
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping(case))
    weight_difference = largest_weight_difference(reference / FINAL_CHECKPOINT, experiment / FINAL_CHECKPOINT,
                                                  tmp_path)
    print(f"\nparity {case} ({layout(case)[0]} ranks) vs chapter 01: largest loss difference {loss_difference:.1e}, "
          f"relative gradient norm difference {norm_difference:.1e}, largest weight difference "
          f"{weight_difference:.1e} after {STEPS} steps")
    assert f"device mesh: {LAYOUTS[case][1]}" in result.stdout
    # fp32 on the CPU: only the order of the floating-point sums differs (slices, shards, stages, ring blocks).
    assert loss_difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    # NOTE: as in chapter 07's test: a weight whose gradient is ~0 moves by ~lr whatever its rounding noise's sign.
    assert weight_difference <= 1e-3


def test_resume_in_the_same_4d_layout_is_exact(env, runs, tmp_path):
    """tp 2 x pp 2 x dp 2 saved after step 3 and resumed on the same layout: steps 4-6 are the uninterrupted run's."""
    _, straight = layout_run(runs, env, "tp2-pp2-dp2")
    _, interrupted = interrupted_run(runs, env)
    assert [path.name for path in interrupted.glob("checkpoint-*")] == [f"checkpoint-{HALF:08d}"]
    shutil.copytree(interrupted, tmp_path / "outputs" / "resumed")
    nproc, flags = layout("tp2-pp2-dp2")
    result, resumed = train("11", env, tmp_path, *COMMON, *flags, nproc=nproc, experiment="resumed")
    assert f"checkpoint-{HALF:08d} at step {HALF}" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    weight_difference = largest_weight_difference(straight / FINAL_CHECKPOINT, resumed / FINAL_CHECKPOINT, tmp_path)
    norm_difference = grad_norm_difference(straight, resumed, clipped=True)
    print(f"\nresume tp2-pp2-dp2 -> the same: largest loss difference {loss_difference:.1e}, gradient norm "
          f"{norm_difference:.1e}, weights {weight_difference:.1e}")
    assert loss_difference == 0.0 and norm_difference == 0.0 and weight_difference == 0.0


def test_a_sigterm_to_torchrun_checkpoints_the_step_the_workers_stop_at_and_resumes_the_curve(env, runs, tmp_path):
    """Kubernetes' SIGTERM goes to the container's first process, torchrun: it passes it to its workers (pp 2, a
    2-rank job), which save the step they agree on and exit 0; torchrun then exits 1 of the signal it got (its
    SignalException). With --async-checkpoint and a save every 2 steps, the stop's save follows one in flight.
    Resumed, the curve is chapter 01's with the same global batch, as every layout's is."""
    _, reference = reference_run(runs, env)
    flags = ["--pp", "2", "--batch-size", str(GLOBAL_BATCH)]
    result, signalled, seconds = train_until_signalled("11", env, tmp_path, *COMMON, *flags, "--async-checkpoint",
                                                       "--ckpt-freq", "2", nproc=2, to="launcher",
                                                       signals=[(logged_step(2), signal.SIGTERM)])
    stopped = read_metrics(signalled)[-1]["step"]
    print(f"\nSIGTERM to torchrun after step 2: stopped at step {stopped}, torchrun exit {result.returncode} "
          f"{seconds:.1f}s after the signal")
    assert 2 < stopped < STEPS
    for rank in (0, 1):
        assert f"[rank {rank}] INFO done: step {stopped} of {STEPS}" in result.stdout, result.stdout[-3000:]
    assert "Received 15 death signal, shutting down workers" in result.stderr
    assert [path.name for path in signalled.glob("*checkpoint-*")] == [f"checkpoint-{stopped:08d}"]
    result, resumed = train("11", env, tmp_path, *COMMON, *flags, nproc=2, experiment="signalled")
    assert f"checkpoint-{stopped:08d} at step {stopped}" in result.stdout
    difference = max_difference(read_losses(reference), read_losses(resumed))
    print(f"resumed from step {stopped}: largest loss difference to chapter 01's uninterrupted run {difference:.1e}")
    assert difference <= 1e-5
    assert grad_norm_difference(reference, resumed, clipped=True) <= GRAD_NORM_TOLERANCE


# Train in 4D, fine-tune in 1D or 2D: (chapter, processes, flags) with chapter 01's global batch of 4.
OTHER_CHAPTERS = {
    "04 dp4": ("04", 4, ["--batch-size", "1"]),
    "07 tp2-dp2": ("07", 4, ["--tp", "2", "--batch-size", "2"]),
}


@pytest.mark.parametrize("case", OTHER_CHAPTERS)
def test_a_4d_checkpoint_resumes_in_chapters_04_and_07(env, runs, tmp_path, case):
    """DCP names every shard by its parameter's name, whatever the mesh (and chapter 08's save lists every stage's
    optimizer state), so chapter 04 and chapter 07 each read their own slices of a tp 2 x pp 2 x dp 2 checkpoint
    and continue the uninterrupted curve."""
    _, straight = layout_run(runs, env, "tp2-pp2-dp2")
    _, interrupted = interrupted_run(runs, env)
    shutil.copytree(interrupted, tmp_path / "outputs" / "resumed")
    chapter, nproc, flags = OTHER_CHAPTERS[case]
    result, resumed = train(chapter, env, tmp_path, *COMMON, *flags, nproc=nproc, experiment="resumed")
    assert f"checkpoint-{HALF:08d} at step {HALF}" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    norm_difference = grad_norm_difference(straight, resumed, clipped=True)
    weight_difference = largest_weight_difference(straight / FINAL_CHECKPOINT, resumed / FINAL_CHECKPOINT, tmp_path)
    print(f"\nresume tp2-pp2-dp2 -> chapter {case}: steps 4-6 vs the straight run: largest loss difference "
          f"{loss_difference:.1e}, gradient norm {norm_difference:.1e}, weights {weight_difference:.1e}")
    assert loss_difference <= 1e-4
    assert norm_difference <= GRAD_NORM_TOLERANCE
    assert weight_difference <= 1e-3


BAD_LAYOUTS = {
    "degrees not dividing the world": (2, ["--tp", "2", "--pp", "2"], "error: --tp 2 x --pp 2 x --cp 1 = 4 does not "
                                       "divide the world size 2; use degrees whose product divides 2"),
    "more stages than layers": (2, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "4"],
                                "error: 8 pipeline stages (--pp 2 x 4 per rank) for 4 decoder layers; use at most 4"),
    "tp not dividing the heads": (3, ["--tp", "3"], "error: the tensor-parallel degree 3 does not divide the key/value "
                                  "heads, MLP width, vocabulary and --seq-length (4, 768, 4096, 64)"),
    "a sequence cp cannot split": (2, ["--cp", "2", "--seq-length", "66"], "error: --seq-length 66 does not split "
                                   "into 4 equal chunks (--cp 2, load balancing on); use a multiple of 4"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_a_layout_that_cannot_be_made_gets_a_one_line_error(env, tmp_path, case):
    nproc, flags, expected = BAD_LAYOUTS[case]
    result, _ = train("11", env, tmp_path, *COMMON, *flags, nproc=nproc, check=False, timeout=180)
    assert result.returncode == 1
    # NOTE: each rank checks the layout on its own, rank 1 after rank 0 (rank_zero_first loads the config): the first
    # to stop prints the line, and torchrun then stops the others, which on a loaded machine may not have printed yet.
    errors = error_lines(result.stderr)
    assert 1 <= len(errors) <= nproc and all(line.startswith(expected) for line in errors), result.stderr[-3000:]
    assert "train_llm.py\", line" not in result.stderr, "a rank printed a traceback"


def test_readme_cpu_commands_are_layouts_tested_here():
    """The README's torchrun commands for the CPU are layouts the parity test runs (with FAST_ARGS and the batch size
    added, from a scratch folder), so they work as written."""
    commands = [shlex.split(line.strip()) for line in README.read_text().splitlines()
                if line.strip().startswith("torchrun --standalone ")]
    # NOTE: with 2 data-parallel ranks or more, --batch-size keeps chapter 01's default global batch of 8.
    tested = [["torchrun", "--standalone", "--nproc-per-node", str(layout(case)[0]), f"{CHAPTERS['11']}/train_llm.py",
               *flags, *(["--batch-size", str(8 // mesh["dp"])] if mesh["dp"] > 1 else [])]
              for case, (flags, mesh) in LAYOUTS.items()]
    assert commands, f"no 'torchrun --standalone ...' command in {README}"
    assert all(without_experiment(command) in tested for command in commands), commands
    # NOTE: each its own experiment: a later one would resume an earlier one's finished run and train nothing
    assert len({readme_experiment(command, "11") for command in commands}) == len(commands)


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("11", runs, env, family_models)
