"""Chapter 06: tensor parallelism on 2 and 4 CPU processes (gloo) trains exactly as chapter 01 does on the same batch;
a model with tied embeddings keeps one matrix (chapter 01's losses and parameter count, exact resume, a converted
Hugging Face folder that is the checkpoint); each module of the chapter's plan computes what the whole model
computes, and a wrong style is named at its module; resume is exact; a degree that does not divide the model gets a one-line error; the README's CPU command runs
as written (tests/test_repo.py checks that its excerpts are the script's lines).

`pytest -s` prints the figures: the largest loss and weight differences from chapter 01, and the module check's.
"""

import json
import re
import shlex
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, NO_CLIPPING, REPO, checkpoint_weights, error_lines,
                     grad_norm_difference, logged_parameter_count, max_difference, read_losses, read_metrics,
                     readme_experiment, run, script, torchrun, train, train_with_a_restart, without_experiment,
                     check_family_matrix)

README = REPO / CHAPTERS["06"] / "README.md"
CONVERT = REPO / CHAPTERS["04"] / "convert_to_hf.py"
LAYER_CHECK = REPO / CHAPTERS["06"] / "tp_layer_check.py"
STEPS = 10
FINAL_CHECKPOINT = f"checkpoint-{STEPS:08d}"


def reference_run(runs, env, *clipping):
    return runs.train("01", env, "--max-steps", STEPS, "--wandb-mode", "disabled", "--batch-size", "4", *clipping)


def tensor_parallel_run(runs, env, degree, *clipping):
    # NOTE: every rank of a tensor-parallel job reads the same 4 sequences: the batch of chapter 01's run.
    return runs.train("06", env, "--max-steps", STEPS, "--batch-size", "4", *clipping, nproc=degree)


# Clipping at 1.0 binds at every step of degree 2; degree 4 runs with NO_CLIPPING (and so does its reference).
@pytest.mark.parametrize("degree", [pytest.param(2, marks=pytest.mark.quick), 4])
def test_tensor_parallel_matches_one_process_on_the_same_batch(env, runs, tmp_path, degree):
    clipping = NO_CLIPPING if degree == 4 else []
    _, reference = reference_run(runs, env, *clipping)
    result, experiment = tensor_parallel_run(runs, env, degree, *clipping)
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping)
    loss_difference = max_difference(read_losses(reference), read_losses(experiment))
    reference_weights = checkpoint_weights(reference / FINAL_CHECKPOINT, tmp_path)
    weights = checkpoint_weights(experiment / FINAL_CHECKPOINT, tmp_path)
    assert weights.keys() == reference_weights.keys()
    differences = {name: (weights[name] - reference_weights[name]).abs() for name in weights}
    largest = max(difference.max().item() for difference in differences.values())
    # NOTE: AdamW's first steps move every weight by about lr whatever the size of its gradient, so a gradient
    # near zero whose rounding differs can move a weight the other way: a few weights differ by up to ~lr/10.
    # A slice that trained wrong would differ in a whole block of weights, not in a few.
    far = sum((difference > 1e-5).sum().item() for difference in differences.values())
    total = sum(difference.numel() for difference in differences.values())
    print(f"\nparity TP {degree} vs chapter 01 (batch 4, {STEPS} steps, fp32): largest loss difference "
          f"{loss_difference:.1e}; largest weight difference {largest:.1e}, {far} of {total} weights beyond 1e-5; "
          f"relative gradient norm difference {norm_difference:.1e}")
    assert loss_difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    assert far <= total * 1e-4
    # Clipped, as chapters 07 and 08 bound it. Unclipped, a gradient near zero keeps more of its rounding noise and
    # moves its weight by up to ~lr (measured 9.7e-4 at degree 4): there the count above is the bound.
    if not clipping:
        assert largest <= 2e-4
    # Only rank 0 logs metrics, once per step; every rank logs its lines, and a checkpoint is one shard per rank.
    assert [record["step"] for record in read_metrics(experiment)] == list(range(1, STEPS + 1))
    assert all(f"[rank {rank}]" in result.stdout for rank in range(degree))
    assert sorted(path.name for path in (experiment / FINAL_CHECKPOINT).glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(degree)]


def tied_runs(runs, env, tied_model):
    """Chapter 01's run and chapter 06's on 2 ranks, on the tiny model with tie_word_embeddings true."""
    args = ["-m", tied_model, "--max-steps", STEPS, "--batch-size", "4"]
    return runs.train("01", env, *args), runs.train("06", env, *args, nproc=2)


def test_a_tied_model_trains_one_matrix_as_chapter_01_does(env, runs, tmp_path, tied_model):
    """parallelize_module() gives the embedding and the head a DTensor each; parallelize_model() ties them again.
    Left untied, the head would start from weights of its own (seeded by its own name) and train apart, with a
    vocabulary x hidden matrix (1.0M parameters here) more than chapter 01 has."""
    (reference_result, reference), (result, experiment) = tied_runs(runs, env, tied_model)
    loss_difference = max_difference(read_losses(reference), read_losses(experiment))
    reference_weights = checkpoint_weights(reference / FINAL_CHECKPOINT, tmp_path)
    weights = checkpoint_weights(experiment / FINAL_CHECKPOINT, tmp_path)
    assert weights.keys() == reference_weights.keys()
    differences = {name: (weights[name] - reference_weights[name]).abs() for name in weights}
    largest = max(difference.max().item() for difference in differences.values())
    far = sum((difference > 1e-5).sum().item() for difference in differences.values())
    total = sum(difference.numel() for difference in differences.values())
    head_vs_embedding = (weights["lm_head.weight"] - weights["model.embed_tokens.weight"]).abs().max().item()
    print(f"\ntied model, TP 2 vs chapter 01 (batch 4, {STEPS} steps, fp32): largest loss difference "
          f"{loss_difference:.1e}; largest weight difference {largest:.1e}, {far} of {total} weights beyond 1e-5; "
          f"parameters {logged_parameter_count(result)} vs {logged_parameter_count(reference_result)}; "
          f"checkpoint's head vs embedding: {head_vs_embedding:.1e}")
    assert loss_difference <= 1e-5
    assert grad_norm_difference(reference, experiment, clipped=True) <= GRAD_NORM_TOLERANCE
    assert far <= total * 1e-4
    assert largest <= 2e-4
    assert logged_parameter_count(result) == logged_parameter_count(reference_result)
    assert head_vs_embedding == 0


def test_a_tied_checkpoint_converts_to_a_hugging_face_model_with_one_matrix(env, runs, tmp_path, tied_model):
    """convert_to_hf.py writes a tied model's matrix once, and from_pretrained() ties the head to it again. The
    reference is the checkpoint as it is (torch's own DCP converter), in a model whose head is a matrix of its own:
    its logits are the converted model's only if the checkpoint's head is its embedding."""
    _, (_, experiment) = tied_runs(runs, env, tied_model)
    checkpoint_dir = experiment / FINAL_CHECKPOINT
    run([sys.executable, CONVERT, checkpoint_dir, "-m", tied_model, "-o", tmp_path / "converted"], env, tmp_path)
    with safe_open(tmp_path / "converted" / "model.safetensors", framework="pt") as saved:
        saved_names = set(saved.keys())
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32)
    untied_config = AutoConfig.from_pretrained(checkpoint_dir / "model_config.json", tie_word_embeddings=False)
    reference = AutoModelForCausalLM.from_config(untied_config, dtype=torch.float32)
    reference.load_state_dict(checkpoint_weights(checkpoint_dir, tmp_path))
    assert reference.lm_head.weight is not reference.model.embed_tokens.weight
    input_ids = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (converted.eval()(input_ids=input_ids).logits
                      - reference.eval()(input_ids=input_ids).logits).abs().max().item()
    print(f"\ntied TP 2 checkpoint converted vs the checkpoint's weights: largest logit difference {difference:.1e}")
    # The matrix is saved once, under the embedding's name, as in Hugging Face's own tied models.
    assert "model.embed_tokens.weight" in saved_names and "lm_head.weight" not in saved_names
    assert converted.config.tie_word_embeddings
    assert converted.lm_head.weight is converted.model.embed_tokens.weight
    assert difference <= 1e-5


def test_a_tied_model_resumes_exactly(env, runs, tmp_path, tied_model):
    """The checkpoint holds the one matrix under both names, and AdamW's moments under the embedding's: loading
    fills the shared parameter from both, and the moments once."""
    _, (_, straight) = tied_runs(runs, env, tied_model)
    _, resumed = train_with_a_restart("06", env, tmp_path, "-m", tied_model, "--max-steps", STEPS, "--batch-size", "4",
                                      stop_after=STEPS // 2, nproc=2)
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    weights_straight = checkpoint_weights(straight / FINAL_CHECKPOINT, tmp_path)
    weights_resumed = checkpoint_weights(resumed / FINAL_CHECKPOINT, tmp_path)
    weight_difference = max((weights_straight[name] - weights_resumed[name]).abs().max().item()
                            for name in weights_straight)
    print(f"\nresume of the tied model, TP 2: largest loss difference {loss_difference:.1e}, largest weight "
          f"difference {weight_difference:.1e}")
    assert loss_difference <= 1e-6
    assert weight_difference <= 1e-6
    assert torch.equal(weights_resumed["lm_head.weight"], weights_resumed["model.embed_tokens.weight"])


def module_check(env, cwd, broken=None):
    check_env = env if broken is None else {**env, "TP_CHECK_BREAK": broken}
    return run([*torchrun(2), LAYER_CHECK], check_env, cwd, check=broken is None)


def test_every_module_of_the_plan_matches_the_whole_model(env, tmp_path):
    result = module_check(env, tmp_path)
    summaries = re.findall(r"^(?:decoder layer 0|whole model): worst .*$", result.stdout, re.MULTILINE)
    print("\nmodule check, TP 2:\n  " + "\n  ".join(summaries))
    assert len(summaries) == 2
    assert "ok: every module output and gradient within 1e-05 (relative) on 2 ranks" in result.stdout
    # Every projection and norm of layer 0 and every parameter of the model was compared.
    for name in ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj", "post_attention_layernorm"]:
        assert re.search(rf"^   model\.layers\.0\.{re.escape(name)} ", result.stdout, re.MULTILINE), name
    assert re.search(r"^   lm_head\.weight .* param \(Shard\(dim=0\),\)", result.stdout, re.MULTILINE)


# What the check reports when one projection of layer 0 has the wrong style. A column-wise o_proj fails at its own
# matmul. A row-wise gate_proj computes the right values, but whole, where its sibling up_proj returns a slice:
# the check names the module that fails on it (mlp) and what each submodule returned.
BROKEN_PLANS = {
    "o_proj-colwise": ["first mismatch at model.layers.0.self_attn.o_proj failed"],
    "gate_proj-rowwise": ["first mismatch at model.layers.0.mlp failed",
                          "model.layers.0.mlp.gate_proj local, whole", "model.layers.0.mlp.up_proj local, Shard(2)"],
}


@pytest.mark.parametrize("broken", BROKEN_PLANS)
def test_a_wrong_style_is_named_at_its_module(env, tmp_path, broken):
    result = module_check(env, tmp_path, broken)
    assert result.returncode != 0
    errors = worker_errors(result)
    assert len(errors) == 1, result.stderr[-3000:]
    print(f"\nmodule check with {broken}: {errors[0]}")
    assert errors[0].startswith("error: decoder layer 0 does not match the whole model")
    for expected in BROKEN_PLANS[broken]:
        assert expected in errors[0]


def worker_errors(result):
    """The distinct one-line errors the workers printed (each rank prints the same one)."""
    return sorted(set(error_lines(result.stderr)))


def test_resume_is_exact(env, runs, tmp_path):
    _, straight = tensor_parallel_run(runs, env, 2)
    args = ["--max-steps", STEPS, "--batch-size", "4"]
    half = STEPS // 2
    train("06", env, tmp_path, *args, "--exit-after-steps", half, nproc=2, experiment="resumed")
    assert [path.name for path in (tmp_path / "outputs" / "resumed").glob("checkpoint-*")] == [
        f"checkpoint-{half:08d}"]
    result, resumed = train("06", env, tmp_path, *args, nproc=2, experiment="resumed")
    assert "resumed from" in result.stdout
    loss_difference = max_difference(read_losses(straight), read_losses(resumed))
    weights_straight = checkpoint_weights(straight / FINAL_CHECKPOINT, tmp_path)
    weights_resumed = checkpoint_weights(resumed / FINAL_CHECKPOINT, tmp_path)
    weight_difference = max((weights_straight[name] - weights_resumed[name]).abs().max().item()
                            for name in weights_straight)
    print(f"\nresume TP 2: {STEPS} steps straight vs {half} + {half}: largest loss difference {loss_difference:.1e}, "
          f"largest weight difference {weight_difference:.1e}")
    assert loss_difference <= 1e-6
    assert weight_difference <= 1e-6
    assert grad_norm_difference(straight, resumed, clipped=True) <= 1e-6


BAD_DEGREES = {
    "3 ranks, 4 key/value heads": (3, [], "the tensor-parallel degree 3 does not divide the key/value heads, MLP "
                                          "width, vocabulary and --seq-length (4, 768, 4096, 64); use a divisor"),
    "2 ranks, 63 tokens": (2, ["--seq-length", "63"], "the tensor-parallel degree 2 does not divide the key/value "
                                                      "heads, MLP width, vocabulary and --seq-length (4, 768, 4096, 63)"),
}


@pytest.mark.parametrize("case", BAD_DEGREES)
def test_a_degree_that_does_not_divide_the_model_gets_a_one_line_error(env, tmp_path, case):
    nproc, args, expected = BAD_DEGREES[case]
    result, _ = train("06", env, tmp_path, "--max-steps", "2", *args, nproc=nproc, check=False, timeout=180)
    assert result.returncode == 1
    errors = worker_errors(result)
    assert len(errors) == 1 and expected in errors[0], result.stderr[-3000:]
    # The workers stopped with the message alone: no traceback through the script.
    assert f'File "{script("06")}"' not in result.stderr


def test_the_readme_cpu_commands_train(env, tmp_path):
    commands = [shlex.split(line.strip()) for line in README.read_text().splitlines()
                if line.strip().startswith("torchrun --standalone --nproc-per-node ")]
    cpu_commands = [command for command in commands
                    if without_experiment(command)[-1] == f"{CHAPTERS['06']}/train_llm.py"]
    assert [command[3] for command in cpu_commands] == ["2", "4"]
    # NOTE: each its own experiment: the second would resume the first's finished run and train nothing
    assert len({readme_experiment(command, "06") for command in cpu_commands}) == 2
    # The 2-process one as written, but from a scratch folder (so that outputs/ lands there) and shortened to
    # 2 steps of 64 tokens; the 4-process one differs only in its count, which the parity test runs.
    result = run([*cpu_commands[0][:-1], script("06"), "--max-steps", "2", "--seq-length", "64"], env, tmp_path)
    experiment = tmp_path / "outputs" / CHAPTERS["06"]
    assert [record["step"] for record in read_metrics(experiment)] == [2]
    assert "rank 1 of 2" in result.stdout and "done: step 2 of 2" in result.stdout


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("06", runs, env, family_models)


VOCAB_PARALLEL_LOSS = """
import importlib.util, json, sys

import torch
import torch.distributed as dist
from transformers.loss.loss_utils import ForCausalLMLoss

spec = importlib.util.spec_from_file_location("chapter", sys.argv[1])
chapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter)
dist.init_process_group("gloo")
rank, vocab = dist.get_rank(), 10
logits = torch.randn(2, 6, vocab, generator=torch.Generator().manual_seed(0)) * 4
# NOTE: labels at both ends of each rank's slice (0, 4 | 5, 9), and -100s, which count for nothing.
labels = torch.tensor([[0, 4, 5, -100, 9, 3], [5, -100, -100, 4, 1, 8]])
differences = {}
for dtype in (torch.float32, torch.bfloat16):
    for num_items in (None, 7):
        whole = logits.to(dtype, copy=True).requires_grad_()
        ForCausalLMLoss(whole, labels, vocab, num_items_in_batch=num_items).backward()
        piece = whole.detach()[..., rank * 5:(rank + 1) * 5].clone().requires_grad_()
        loss = chapter.vocab_parallel_loss(piece, labels, vocab, num_items_in_batch=num_items,
                                           tp_group=dist.group.WORLD)
        loss.backward()
        expected = ForCausalLMLoss(whole.detach(), labels, vocab, num_items_in_batch=num_items)
        differences[f"{str(dtype)[6:]}, {num_items}"] = [
            abs(loss.item() - expected.item()), str(piece.grad.dtype)[6:],
            (piece.grad.float() - whole.grad[..., rank * 5:(rank + 1) * 5].float()).abs().max().item()]
# NOTE: one write: the ranks share torchrun's stdout, and print() writes the line and its end apart.
sys.stdout.write(json.dumps(differences) + "\\n")
dist.destroy_process_group()
"""


def test_the_vocab_parallel_loss_is_transformers_loss_and_gradient(env, tmp_path):
    """The loss 06, 07 and 11 compute from each rank's slice of the logits (2 ranks, a vocabulary of 10), against
    transformers' ForCausalLMLoss of the whole logits: labels at both ends of each slice and -100s, the mean over the
    labelled tokens and a sum over num_items_in_batch, in fp32 and bf16 (its gradient in the logits' dtype)."""
    program = tmp_path / "vocab_parallel_loss.py"
    program.write_text(VOCAB_PARALLEL_LOSS)
    result = run([*torchrun(2), program, script("06")], env, tmp_path)
    for line in [line for line in result.stdout.splitlines() if line.startswith("{")]:
        for case, (loss, grad_dtype, grad) in json.loads(line).items():
            print(f"\n{case}: loss {loss:.1e}, gradient ({grad_dtype}) {grad:.1e}")
            assert grad_dtype == case.split(",")[0] and loss <= 1e-6 and grad <= (1e-7 if "float32" in case else 0)
    assert result.stdout.count("{") == 2
