"""Chapter 08: pipeline parallelism on CPU processes (gloo) trains exactly as chapter 01 does with the same global
batch, for each schedule and with FSDP inside the stages, with gradient clipping that binds; each schedule runs the
micro-batches in its own order and holds the activations it should; resume is exact, a checkpoint resumes at another
--pp and in chapter 04; a layout that cannot be made gets a one-line error.

`pytest -s` prints the figures: the largest loss, gradient-norm and weight differences from chapter 01, the
activations each stage held, and the differences after a resume.
Every run trains 6 steps of 4 sequences of 64 tokens.
"""

import json
import shlex
import shutil
import sys

import pytest

from helpers import (CHAPTERS, REPO, TINY_MODEL, checkpoint_weights, error_line, error_lines, load_script,
                     max_difference, read_losses, read_metrics, readme_experiment, run, torchrun, train, with_faults,
                     without_experiment, check_family_matrix)
from helpers import quick_cases

sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402
from measure_step import read_measurements  # noqa: E402

README = REPO / CHAPTERS["08"] / "README.md"
MEASURE_PIPELINE = REPO / CHAPTERS["08"] / "measure_pipeline.py"
STEPS, HALF = 6, 3
# NOTE: the gradient norm of these first steps is 2 to 6: clipping at 0.5 scales every step's gradients, so a norm
# computed over one stage only would change the training (and the logged norm) at once.
MAX_GRAD_NORM = 0.5
COMMON = ["--max-steps", str(STEPS), "--wandb-mode", "disabled", "--max-grad-norm", str(MAX_GRAD_NORM)]
GLOBAL_BATCH = 4
SEQ_LENGTH = 64  # FAST_ARGS' --seq-length
FINAL_CHECKPOINT = f"checkpoint-{STEPS:08d}"

# Each layout: (processes, flags). Every one trains chapter 01's global batch of 4 sequences a step:
# --batch-size x --grad-accum x dp = 4.
LAYOUTS = {
    "pp2-gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe", "--pp-microbatches", "4", "--batch-size", "4"]),
    "pp2-1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b", "--pp-microbatches", "4", "--batch-size", "4"]),
    # 4 stages of one layer, 2 on each rank; 2 micro-steps of 2 sequences each, as 2 micro-batches.
    "pp2-interleaved-1f1b": (2, ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-microbatches", "2",
                                 "--batch-size", "2", "--grad-accum", "2"]),
    # Zero bubble: the same, each backward's weight gradients computed apart, in the idle time of the other stage;
    # --global-batch-size 4 sets the 2 micro-steps (2 sequences on 1 data-parallel rank).
    "pp2-interleaved-zb": (2, ["--pp", "2", "--pp-schedule", "interleaved-zb", "--pp-microbatches", "2",
                               "--batch-size", "2", "--global-batch-size", "4", "--pp-grad-reduce", "step"]),
    # ZBV: a rank's stages in a V (rank 0 runs stages 0 and 3), 2 micro-batches (fewer than its 2p - 1 = 3 slots).
    "pp2-zbv": (2, ["--pp", "2", "--pp-schedule", "zbv", "--pp-microbatches", "2", "--batch-size", "4",
                    "--pp-grad-reduce", "step"]),
    "pp2-dp2-1f1b": (4, ["--pp", "2", "--pp-schedule", "1f1b", "--pp-microbatches", "2", "--batch-size", "2"]),
    # PipelineStage's own reduction: each FSDP group reduce-scattered once a step, after the last micro-batch.
    "pp2-dp2-1f1b-reduce-per-step": (4, ["--pp", "2", "--pp-schedule", "1f1b", "--pp-microbatches", "2",
                                         "--batch-size", "2", "--pp-grad-reduce", "step"]),
}


def reference_run(runs, env):
    return runs.train("01", env, *COMMON, "--batch-size", str(GLOBAL_BATCH))


def layout_run(runs, env, case):
    nproc, flags = LAYOUTS[case]
    return runs.train("08", env, *COMMON, *flags, nproc=nproc)


def interrupted_run(runs, env):
    """pp 2 with 1F1B, stopped after step 3 of 6: the experiment holds checkpoint-00000003 and the metrics of 1-3."""
    nproc, flags = LAYOUTS["pp2-1f1b"]
    return runs.train("08", env, *COMMON, *flags, "--exit-after-steps", str(HALF), nproc=nproc)


def resumed_copy(runs, env, tmp_path):
    """A copy of the interrupted experiment, in tmp_path's outputs/resumed."""
    _, interrupted = interrupted_run(runs, env)
    assert [path.name for path in interrupted.glob("checkpoint-*")] == [f"checkpoint-{HALF:08d}"]
    shutil.copytree(interrupted, tmp_path / "outputs" / "resumed")


def largest_weight_difference(checkpoint_a, checkpoint_b, scratch_dir):
    weights_a, weights_b = checkpoint_weights(checkpoint_a, scratch_dir), checkpoint_weights(checkpoint_b, scratch_dir)
    assert weights_a.keys() == weights_b.keys(), sorted(weights_a.keys() ^ weights_b.keys())
    return max((weights_a[name] - weights_b[name]).abs().max().item() for name in weights_a)


def pipeline_records(runs, env, case):
    """The layout's run recorded by measure_pipeline.py --record: its pipeline.jsonl, per logging step, every rank's
    busy time, timeline and peak activations."""
    nproc, flags = LAYOUTS[case]
    _, experiment = runs.train("08", env, *COMMON, *flags, nproc=nproc,
                               launcher=[*torchrun(nproc), MEASURE_PIPELINE, "--record"])
    return [json.loads(line) for line in (experiment / "pipeline.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", quick_cases(LAYOUTS, "pp2-1f1b"))
def test_every_schedule_and_layout_matches_one_process_with_the_same_global_batch(env, runs, tmp_path, case):
    _, reference = reference_run(runs, env)
    result, experiment = layout_run(runs, env, case)
    reference_records, records = read_metrics(reference), read_metrics(experiment)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    loss_difference = max_difference(read_losses(reference), read_losses(experiment))
    norm_difference = max(abs(record["grad_norm"] / reference_record["grad_norm"] - 1)
                          for record, reference_record in zip(records, reference_records))
    weight_difference = largest_weight_difference(reference / FINAL_CHECKPOINT, experiment / FINAL_CHECKPOINT,
                                                  tmp_path)
    print(f"\nparity {case} vs chapter 01: largest loss difference {loss_difference:.1e}, relative gradient norm "
          f"difference {norm_difference:.1e}, weights {weight_difference:.1e} after {STEPS} steps (clipped at "
          f"{MAX_GRAD_NORM}; norms {min(r['grad_norm'] for r in records):.2f} to "
          f"{max(r['grad_norm'] for r in records):.2f})")
    pp = int(LAYOUTS[case][1][1])
    assert f"device mesh: {{'pp': {pp}, 'dp': {LAYOUTS[case][0] // pp}}}" in result.stdout
    # Clipping binds at every step, and the norm is the whole model's: chapter 01's. FSDP over 2 ranks alone (as in
    # chapter 04) moves it by ~1e-5 of itself at step 1 and ~1e-4 by step 6: fp32 sums of squares of 1M-element
    # gradients, added in another order. One stage's own norm is far off (15% and 47% below the whole model's:
    # test_one_stage_alone_has_another_gradient_norm).
    assert all(record["grad_norm"] > 2 * MAX_GRAD_NORM for record in records)
    assert norm_difference <= 3e-4
    # fp32 on the CPU: only the order of the floating-point sums differs (micro-batches, shards, stages).
    assert loss_difference <= 1e-5
    # AdamW divides by the root of the squared gradients, so a weight whose gradient is ~0 (a rare token's
    # embedding row) moves by ~lr whatever the sign of its rounding noise: weights agree less closely than losses.
    assert weight_difference <= 2e-4


def test_one_stage_alone_has_another_gradient_norm():
    """Why the norm must be summed over the stages: chapter 01's initial model, 4 seeded random sequences of 64
    tokens, and the norm of the gradients of each of chapter 08's two stages (its own split) against the whole's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    chapter_01, chapter_08 = load_script("01"), load_script("08")
    config = AutoConfig.from_pretrained(TINY_MODEL)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    chapter_01.init_weights(model, 0)
    input_ids = torch.randint(0, config.vocab_size, (4, SEQ_LENGTH), generator=torch.Generator().manual_seed(0))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    gradients = {name: param.grad for name, param in model.named_parameters()}
    stage_names = []
    for pp_rank in range(2):
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(config)
        chapter_08.split_into_stages(meta_model, pp_rank, 2, 1, position_ids=None)
        stage_names.append([name for name, _ in meta_model.named_parameters()])
    assert sorted(stage_names[0] + stage_names[1]) == sorted(gradients)

    def norm(names):
        return torch.linalg.vector_norm(torch.stack([gradients[name].norm() for name in names])).item()

    whole, stage_norms = norm(list(gradients)), [norm(names) for names in stage_names]
    print(f"\ngradient norm of the whole model {whole:.2f}; stage 0 alone {stage_norms[0]:.2f}, stage 1 alone "
          f"{stage_norms[1]:.2f}; the squares add up: {(stage_norms[0] ** 2 + stage_norms[1] ** 2) ** 0.5:.2f}")
    assert (stage_norms[0] ** 2 + stage_norms[1] ** 2) ** 0.5 == pytest.approx(whole, rel=1e-5)
    assert all(stage_norm < 0.9 * whole for stage_norm in stage_norms)


@pytest.mark.quick
def test_zbv_puts_a_ranks_two_stages_in_a_v():
    """split_into_stages(v_shape=True) at --pp 2: rank 0 holds stages 0 and 3 (layers 0 and 3, the embeddings, the
    final norm and the head), rank 1 stages 1 and 2 (layers 1 and 2 only); round-robin gives rank 0 stages 0 and 2."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    chapter_08, config = load_script("08"), AutoConfig.from_pretrained(TINY_MODEL)
    held = {}
    for pp_rank, v_shape in [(0, True), (1, True), (0, False)]:
        with torch.device("meta"):
            meta_model = AutoModelForCausalLM.from_config(config)
        stages = chapter_08.split_into_stages(meta_model, pp_rank, 2, 2, position_ids=None, v_shape=v_shape)
        held[pp_rank, v_shape] = ([(stage.stage_index, list(stage.layers)) for stage in stages],
                                  {name.split(".")[-2] for name, _ in meta_model.named_parameters()
                                   if ".layers." not in name})
    assert held[0, True] == ([(0, ["0"]), (3, ["3"])], {"embed_tokens", "norm", "lm_head"})
    assert held[1, True] == ([(1, ["1"]), (2, ["2"])], set())
    assert held[0, False][0] == [(0, ["0"]), (2, ["2"])]


def microbatch_order(record, pp_rank):
    """The (kind, stage, micro-batch) sequence a rank of the first pipeline computed, in time order (R: the
    gradient reduction after a stage's last backward, micro-batch None); the loss is part of its micro-batch's
    forward."""
    stats = next(stats for stats in record["ranks"] if stats["pp_rank"] == pp_rank and stats["dp_rank"] == 0)
    return [(kind[0].upper(), stage, microbatch) for kind, stage, microbatch, _, _ in stats["events"]
            if kind != "loss"]


def test_each_schedule_runs_the_micro_batches_in_its_order(env, runs):
    gpipe, one_f_one_b = (pipeline_records(runs, env, case)[-1] for case in ["pp2-gpipe", "pp2-1f1b"])
    forwards = [("F", None, i) for i in range(4)]
    backwards = [("B", None, i) for i in range(4)] + [("R", None, None)]

    def on_stage(order, stage):
        return [(kind, stage, microbatch) for kind, _, microbatch in order]

    # GPipe: every stage runs all 4 forwards, then all 4 backwards.
    assert microbatch_order(gpipe, 0) == on_stage(forwards + backwards, 0)
    assert microbatch_order(gpipe, 1) == on_stage(forwards + backwards, 1)
    # 1F1B: stage 0 runs p - 0 = 2 forwards ahead, then alternates; the last stage alternates from the start.
    assert microbatch_order(one_f_one_b, 0) == on_stage(
        [forwards[0], forwards[1], backwards[0], forwards[2], backwards[1], forwards[3], *backwards[2:]], 0)
    assert microbatch_order(one_f_one_b, 1) == on_stage(
        [item for pair in zip(forwards, backwards) for item in pair] + backwards[4:], 1)
    # The reduction is timed apart: the idle time is the schedule's span less the computations and the reduction.
    for record in (gpipe, one_f_one_b):
        for stats in record["ranks"]:
            reduce_ms = sum(end - start for kind, *_, start, end in stats["events"] if kind == "reduce")
            assert stats["reduce_ms"] == pytest.approx(reduce_ms) and reduce_ms > 0
            assert stats["busy_ms"] + reduce_ms == pytest.approx(sum(end - start for *_, start, end in stats["events"]))
    # Interleaved: rank 0 runs stages 0 and 2, rank 1 stages 1 and 3; each micro-batch goes 0 -> 1 -> 2 -> 3 and
    # back. The step's 2 micro-steps of 2 micro-batches are one schedule of 4, in rounds of p = 2: one fill and one
    # drain a step. Rank r runs (stages per rank - 1) x p + 2 x (p - 1 - r) forwards ahead (4 on rank 0, 2 on rank 1),
    # then alternates one forward and one backward; each stage reduces after its last backward.
    interleaved = pipeline_records(runs, env, "pp2-interleaved-1f1b")[-1]
    step = {0: [("F", 0, 0), ("F", 0, 1), ("F", 2, 0), ("F", 2, 1), ("F", 0, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1),
                ("F", 2, 2), ("B", 0, 0), ("F", 2, 3), ("B", 0, 1), ("B", 2, 2), ("B", 2, 3), ("R", 2, None),
                ("B", 0, 2), ("B", 0, 3), ("R", 0, None)],
            1: [("F", 1, 0), ("F", 1, 1), ("F", 3, 0), ("B", 3, 0), ("F", 3, 1), ("B", 3, 1), ("F", 1, 2), ("B", 1, 0),
                ("F", 1, 3), ("B", 1, 1), ("F", 3, 2), ("B", 3, 2), ("F", 3, 3), ("B", 3, 3), ("R", 3, None),
                ("B", 1, 2), ("B", 1, 3), ("R", 1, None)]}
    for pp_rank in (0, 1):
        assert microbatch_order(interleaved, pp_rank) == step[pp_rank]


def test_1f1b_holds_the_activations_of_fewer_micro_batches_than_gpipe(env, runs):
    """GPipe runs all m forwards before the first backward: every stage holds m micro-batches' activations at once.
    1F1B starts backwards as soon as it can: stage s of p holds at most p - s. Here p = 2, m = 4."""
    lines = []
    peaks = {}
    for case in ["pp2-gpipe", "pp2-1f1b"]:
        record = pipeline_records(runs, env, case)[-1]
        for stats in record["ranks"]:
            peaks[case, stats["pp_rank"]] = (stats["peak_microbatches"], stats["peak_activations_mb"])
            lines.append(f"{case} stage {stats['pp_rank']}: {stats['peak_microbatches']} micro-batches, "
                         f"{stats['peak_activations_mb']:.1f} MB")
    print("\nactivations held at the peak (saved-tensor hooks, step 6):\n" + "\n".join(lines))
    assert [peaks["pp2-gpipe", stage][0] for stage in (0, 1)] == [4, 4]
    assert [peaks["pp2-1f1b", stage][0] for stage in (0, 1)] == [2, 1]
    for stage, held in [(0, 2), (1, 1)]:
        gpipe_mb, one_f_one_b_mb = peaks["pp2-gpipe", stage][1], peaks["pp2-1f1b", stage][1]
        # Every micro-batch keeps the same tensors: the peaks are in proportion to the micro-batches held.
        assert one_f_one_b_mb == pytest.approx(gpipe_mb * held / 4, rel=0.01)


def test_measure_pipeline_tables_each_schedule_and_draws_its_timeline(env, tmp_path):
    """The README's measurement, small: 1F1B with 2 stages at m = 1 (a layout the script refuses: a row of its own)
    and m = 2 (the formula's (p-1)/(m+p-1) = 33%, stage 0 holding 2 micro-batches, stage 1 one), 3 steps."""
    import re

    figure = tmp_path / "schedules.png"
    result = run([sys.executable, MEASURE_PIPELINE, "--schedules", "1f1b", "--microbatches", "1", "2", "--steps", "3",
                  "--figure-microbatches", "2", "--figure", figure], env, tmp_path)
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 1f1b |")]
    print("\n" + "\n".join(rows))
    assert len(rows) == 3 and rows[0].startswith("| 1f1b | 1 | | error: --pp-schedule 1f1b needs"), result.stdout
    assert re.fullmatch(r"\| 1f1b \| 2 \| 33% \| (\d+, \d+, \*\*\d+%\*\* \| ){2}", rows[1] + " "), rows[1]
    assert re.fullmatch(r"\| 1f1b \| 2 \| 2, [\d.]+ \| 1, [\d.]+ \|", rows[2]), rows[2]
    assert figure.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("pp, grad_reduce", [("1", "microbatch"), ("2", "microbatch"), ("2", "step")])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_full_size_gradients_are_reduce_scattered_in_every_backward_as_estimated(env, tmp_path, pp, grad_reduce,
                                                                                   dtype):
    """PipelineStage alone keeps a stage's whole gradients unsharded, in fp32, from the first micro-batch's backward
    to the step's end (12.6 MB on stage 0 at --pp 2 in bf16 here: 4 bytes x its 2.6M parameters, and a bf16 group);
    the chapter reduce-scatters each FSDP group's in every backward, as chapter 04 does, unless --pp-grad-reduce step
    asks for PipelineStage's way. The bytes of full-size gradients alive at the step's peak, measured by
    tools/measure_step.py, are tools/estimate_memory.py's, to the byte."""
    out = tmp_path / "measured"
    train("08", env, tmp_path, "--max-steps", "1", "--wandb-mode", "disabled", "--pp", pp, "--dtype", dtype,
          "--pp-grad-reduce", grad_reduce, launcher=[*torchrun(2), REPO / "tools" / "measure_step.py", "--out", out])
    config = estimate_memory.load_config(TINY_MODEL)
    lines = []
    for rank, measurement in sorted(read_measurements(out).items()):
        # NOTE: FAST_ARGS' --batch-size 4 makes 4 micro-batches of one sequence.
        predicted = estimate_memory.estimate_step(config, estimate_memory.Layout(
            pp=int(pp), dp=2 // int(pp), fsdp=True, dtype=dtype, rank=rank, batch_size=1, grad_accum=4,
            seq_length=SEQ_LENGTH, pp_grad_reduce=grad_reduce))["full_size_grads_peak_bytes"]
        measured = [step["peak_full_size_grad_bytes"] for step in measurement["steps"]]
        lines.append(f"--pp {pp} --pp-grad-reduce {grad_reduce} {dtype} rank {rank}: measured {measured}, "
                     f"estimated {predicted:,} bytes")
        assert measured == [predicted]
    print("\n" + "\n".join(lines))


RESUMES = {
    # At the same layout: exact.
    "pp2-1f1b": ("08", 2, LAYOUTS["pp2-1f1b"][1]),
    # At --pp 1: one stage holding all layers, FSDP over 2 ranks, the same global batch.
    "pp1-dp2": ("08", 2, ["--pp", "1", "--batch-size", "2"]),
    # In chapter 04, FSDP over 2 ranks: the checkpoint holds the whole model under chapter 04's names.
    "chapter-04-fsdp2": ("04", 2, ["--batch-size", "2"]),
}


@pytest.mark.parametrize("case", RESUMES)
def test_a_checkpoint_resumes_exactly_at_the_same_layout_at_another_pp_and_in_chapter_04(env, runs, tmp_path, case):
    """Saved at pp 2 after step 3; resumed to step 6. The optimizer's state and parameter group carry over by
    parameter name whichever rank holds the parameter, and the data position is a count of global samples."""
    _, straight = layout_run(runs, env, "pp2-1f1b")
    resumed_copy(runs, env, tmp_path)
    chapter, nproc, flags = RESUMES[case]
    result, resumed = train(chapter, env, tmp_path, *COMMON, *flags, nproc=nproc, experiment="resumed")
    assert f"checkpoint-{HALF:08d} at step {HALF}" in result.stdout
    straight_records, resumed_records = read_metrics(straight), read_metrics(resumed)
    assert [record["step"] for record in resumed_records] == list(range(1, STEPS + 1))
    assert max(abs(a["lr"] - b["lr"]) for a, b in zip(straight_records, resumed_records)) <= 1e-12
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    weight_difference = largest_weight_difference(straight / FINAL_CHECKPOINT, resumed / FINAL_CHECKPOINT, tmp_path)
    print(f"\nresume pp2-1f1b -> {case}: {STEPS} steps straight vs {HALF} + {STEPS - HALF}: largest loss difference "
          f"{loss_difference:.1e}, largest weight difference {weight_difference:.1e}")
    if case == "pp2-1f1b":
        assert loss_difference <= 1e-6 and weight_difference == 0.0
    else:
        assert loss_difference <= 1e-5 and weight_difference <= 2e-4


def test_a_crash_during_a_save_leaves_the_previous_checkpoint_to_resume_from(env, runs, tmp_path):
    """Resumed at pp 2 after step 3, saving every step, every rank dies inside the step-5 save (the 2nd dcp.save of
    that run, after its shards are written, before the folder is renamed); resumed again from checkpoint-00000004
    to step 6. Together: the uninterrupted run's losses and weights."""
    _, straight = layout_run(runs, env, "pp2-1f1b")
    resumed_copy(runs, env, tmp_path)
    nproc, flags = LAYOUTS["pp2-1f1b"]
    crash_env = with_faults(env, FAULT_KILL_ON_CALL="torch.distributed.checkpoint.save:2")
    result, crashed = train("08", crash_env, tmp_path, *COMMON, *flags, "--ckpt-freq", "1", nproc=nproc,
                            experiment="resumed", check=False)
    assert result.returncode != 0 and f"checkpoint-{HALF:08d} at step {HALF}" in result.stdout
    assert sorted(path.name for path in crashed.iterdir() if "checkpoint" in path.name) == [
        "checkpoint-00000004", "tmp-checkpoint-00000005"]
    result, _ = train("08", env, tmp_path, *COMMON, *flags, nproc=nproc, experiment="resumed")
    assert "checkpoint-00000004 at step 4" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(crashed))
    weight_difference = largest_weight_difference(straight / FINAL_CHECKPOINT, crashed / FINAL_CHECKPOINT, tmp_path)
    print(f"\npp2-1f1b: exit after {HALF}, crash in the save of 5, resume from 4: largest loss difference "
          f"{loss_difference:.1e}, largest weight difference {weight_difference:.1e}")
    assert loss_difference <= 1e-6 and weight_difference == 0.0


def test_chapter_04s_converter_turns_a_pipeline_checkpoint_into_a_hugging_face_model(env, runs, tmp_path):
    """convert_to_hf.py of chapter 04 reads the shards of both stages into one model: from_pretrained() gives the
    checkpoint's weights, every one of them, exactly."""
    import torch
    from transformers import AutoModelForCausalLM

    _, experiment = layout_run(runs, env, "pp2-1f1b")
    run([sys.executable, REPO / CHAPTERS["04"] / "convert_to_hf.py", experiment / FINAL_CHECKPOINT,
         "-o", tmp_path / "hf"], env, tmp_path)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    saved = checkpoint_weights(experiment / FINAL_CHECKPOINT, tmp_path)
    assert converted.keys() == saved.keys()
    assert all(torch.equal(converted[name], saved[name]) for name in saved)


BAD_LAYOUTS = {
    "pp not dividing the world": (2, ["--pp", "3"],
                                  "error: --pp 3 does not divide the world size 2; use a divisor of 2"),
    # NOTE: before --global-batch-size divides by the data-parallel size, which would be 0.
    "pp above the world, with a global batch": (2, ["--pp", "4", "--global-batch-size", "16"],
                                                "error: --pp 4 does not divide the world size 2; use a divisor of 2"),
    "micro-batches not dividing the batch": (None, ["--pp-microbatches", "3"],
                                             "error: --pp-microbatches 3 does not divide --batch-size 4; "
                                             "use a divisor of 4"),
}


@pytest.mark.parametrize("case", BAD_LAYOUTS)
def test_a_bad_pp_or_micro_batch_count_gets_a_one_line_error(env, tmp_path, case):
    nproc, flags, expected = BAD_LAYOUTS[case]
    result, _ = train("08", env, tmp_path, *COMMON, *flags, nproc=nproc, check=False, timeout=180)
    assert result.returncode == 1
    if nproc is None:
        assert error_line(result).startswith(expected), result.stderr[-3000:]
    else:
        # NOTE: each rank checks the layout on its own, rank 1 after rank 0 (rank_zero_first loads the config): the
        # first to stop prints the line; torchrun then stops the others, which on a busy machine may not have printed.
        errors = error_lines(result.stderr)
        assert 1 <= len(errors) <= nproc and all(line.startswith(expected) for line in errors), result.stderr[-3000:]
    assert "train_llm.py\", line" not in result.stderr, "a rank printed a traceback"


# The other layouts that cannot be made, checked by the script's own check_pipeline_layout(), which main() calls
# before anything else uses the layout: (flags, a change to the tiny model's config, the error).
LAYOUT_ERRORS = {
    "more stages than layers": (["--pp-schedule", "interleaved-1f1b", "--pp-stages-per-rank", "5"], {},
                                "5 pipeline stages (--pp 1 x 5 per rank) for 4 decoder layers; use at most 4, or a "
                                "smaller --pp"),
    "several stages for a one-stage schedule": (["--pp", "2", "--pp-schedule", "gpipe", "--pp-stages-per-rank",
                                                 "2"], {},
                                                "--pp-schedule gpipe takes --pp-stages-per-rank 1, not 2; "
                                                "leave it out"),
    "one stage for the interleaved schedule": (["--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                                "--pp-stages-per-rank", "1"], {},
                                               "--pp-schedule interleaved-1f1b takes --pp-stages-per-rank 2 "
                                               "or more, not 1; leave it out"),
    "fewer micro-batches than stages for 1f1b": (["--pp", "2", "--pp-microbatches", "1"], {},
                                                 "--pp-schedule 1f1b needs at least one micro-batch per stage in a "
                                                 "step, not 1 (--pp-microbatches x --grad-accum); use 2 or more, or "
                                                 "gpipe"),
    "three stages a rank in a V": (["--pp", "2", "--pp-schedule", "zbv", "--pp-grad-reduce", "step",
                                    "--pp-stages-per-rank", "3"], {},
                                   "--pp-schedule zbv takes --pp-stages-per-rank 2, not 3; leave it out"),
    "interleaved rounds": (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-microbatches", "5",
                            "--batch-size", "10"], {},
                           "5 micro-batches a step (--pp-microbatches x --grad-accum) cannot make 2 equal rounds of "
                           "interleaved-1f1b; use a multiple of --pp 2"),
    "zero bubble reducing in every micro-batch": (["--pp", "2", "--pp-schedule", "interleaved-zb"], {},
                                                  "--pp-schedule interleaved-zb splits each backward in two; use "
                                                  "--pp-grad-reduce step, without --compile or "
                                                  "--activation-checkpointing"),
    "zbv reducing in every micro-batch": (["--pp", "2", "--pp-schedule", "zbv"], {},
                                          "--pp-schedule zbv splits each backward in two; use --pp-grad-reduce step"),
    "zbv compiled": (["--pp", "2", "--pp-schedule", "zbv", "--pp-grad-reduce", "step", "--compile"], {},
                     "--pp-schedule zbv splits each backward in two"),
    # NOTE: a checkpointed layer recomputes its forward in the input backward and again in the weight backward.
    "zero bubble with checkpointed layers": (["--pp", "2", "--pp-schedule", "interleaved-zb", "--pp-grad-reduce",
                                              "step", "--activation-checkpointing"], {},
                                             "--pp-schedule interleaved-zb splits each backward in two"),
    "tied embeddings across stages": (["--pp", "2"], {"tie_word_embeddings": True},
                                      "tie_word_embeddings: the first and last stages cannot share one weight"),
}


@pytest.mark.parametrize("case", LAYOUT_ERRORS)
def test_every_layout_that_cannot_be_made_is_named(case, monkeypatch):
    from transformers import AutoConfig

    flags, config_changes, expected = LAYOUT_ERRORS[case]
    chapter = load_script("08")
    monkeypatch.setattr("sys.argv", ["train_llm.py", *flags])
    args = chapter.parse_args()
    config = AutoConfig.from_pretrained(TINY_MODEL)
    for key, value in config_changes.items():
        setattr(config, key, value)
    with pytest.raises(SystemExit) as stopped:
        chapter.check_pipeline_layout(args, config)
    assert str(stopped.value).startswith(f"error: {expected}")
    # The same layout with what is wrong taken away passes the check.
    if config_changes:
        chapter.check_pipeline_layout(args, AutoConfig.from_pretrained(TINY_MODEL))


def test_zero_bubble_runs_a_checkpointed_layer_three_times_so_the_pair_is_refused():
    """torch's zero-bubble backward, an input pass and then a weight pass, recomputes a checkpointed layer in each: the
    reason check_pipeline_layout() refuses --activation-checkpointing with interleaved-zb (lift it when this fails)."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import checkpoint

    layer, forwards = torch.nn.Linear(8, 8), []

    def forward(hidden_states):
        forwards.append(1)
        return torch.relu(layer(hidden_states)).square()

    hidden_states = torch.randn(4, 8, requires_grad=True)
    output = checkpoint(forward, hidden_states, use_reentrant=False)
    _, weight_groups = stage_backward_input([output], [torch.ones_like(output)], [hidden_states], layer.parameters())
    assert len(forwards) == 2 and layer.weight.grad is None
    stage_backward_weight(layer.parameters(), weight_groups)
    assert len(forwards) == 3 and layer.weight.grad.abs().sum() > 0


def test_the_readme_cpu_commands_are_layouts_tested_here():
    """The README's torchrun commands for the CPU run layouts (processes, --pp, schedule) that the parity test runs;
    only the batch size differs (the script's default, 8 sequences in 8 micro-batches)."""
    commands = [shlex.split(line.strip()) for line in README.read_text().splitlines()
                if line.strip().startswith("torchrun --standalone ")]
    assert commands, f"no 'torchrun --standalone ...' command in {README}"

    def layout_of(nproc, flags):
        options = dict(zip(flags[::2], flags[1::2]))
        return int(nproc), options.get("--pp", "1"), options.get("--pp-schedule", "1f1b")

    tested = {layout_of(nproc, flags) for nproc, flags in LAYOUTS.values()}
    layouts = set()
    for command in commands:
        assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", command[3]]
        # NOTE: the chapter's script, or the script recorded by measure_pipeline.py (pipeline_records runs it so)
        recorded = command[4:6] == [f"{CHAPTERS['08']}/measure_pipeline.py", "--record"]
        flags = command[7:] if recorded else command[5:]
        assert command[6 if recorded else 4] == f"{CHAPTERS['08']}/train_llm.py", command
        assert layout_of(command[3], without_experiment(flags)) in tested, command
        layouts.add(layout_of(command[3], without_experiment(flags)))
    assert layouts == tested
    # NOTE: each its own experiment: a later one would resume an earlier one's finished run and train nothing
    assert len({readme_experiment(command, "08") for command in commands}) == len(commands)


def test_an_empty_data_file_stops_every_rank_with_the_one_line(env, tmp_path):
    # Rank 0 loads the data first while rank 1 waits (rank_zero_first): its error line reaches rank 1, which stops with
    # it too, where it reported "Connection closed by peer" before.
    (tmp_path / "empty.jsonl").write_text("")
    result, _ = train("08", env, tmp_path, *COMMON, "-d", tmp_path / "empty.jsonl", nproc=2, check=False, timeout=120)
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all(line.startswith("error: cannot load -d ") and "(it holds no data)" in line
                                    for line in errors), result.stderr[-3000:]
    assert "train_llm.py\", line" not in result.stderr and "Connection closed" not in result.stderr


def test_a_missing_text_column_stops_every_rank_with_the_one_line(env, tmp_path):
    # Sharded, under torchrun: every rank ends with the chapter's error line, promptly (no rank waits for another
    # at a collective until the timeout), and without a traceback.
    result, _ = train("08", env, tmp_path, *COMMON, "--text-column", "nope", nproc=2, check=False, timeout=120)
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and all(line.startswith("error: no text column 'nope'")
                                    for line in errors), result.stderr[-3000:]
    assert "train_llm.py\", line" not in result.stderr and "Connection closed" not in result.stderr


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("08", runs, env, family_models)
