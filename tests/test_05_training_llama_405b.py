"""Chapter 05: a model trained by chapter 04 and converted to a Hugging Face folder loads into the shards exactly
(each rank holds its own slices of the safetensors files, and the first loss is the one transformers computes on the
answers alone); fine-tuning data is labelled on its answers in each schema, packed rows attend within each example,
and the loss per token of the global batch is the same at any layout (a mean of means is not);
activation checkpointing changes the memory but not the losses (compile: tests/test_compile.py); resume is exact and
takes precedence over the pretrained weights; CUDA-only features fail clearly on the CPU; the launch and download
scripts pass what a 405B run needs.

The pretrained model, and the eager run the other features are compared with, are made once per session
(the `runs` fixture of conftest.py). `pytest -s` prints the figures.
"""

import fnmatch
import json
import os
import re
import shutil
import sys

import datasets
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import (CHAPTERS, COUNTING_RUN, FAST_ARGS, GRAD_NORM_TOLERANCE, NO_CLIPPING, PLAIN_TEXT, REPO, TINY_CHAT,
                     TINY_CORPUS, TINY_MODEL, checkpoint_weights, counted, error_line, grad_norm_difference,
                     load_script, logged_parameter_count, max_difference, model_without_chat_template, read_losses,
                     read_metrics, run, script, torchrun, train, check_family_matrix)

CHAPTER = REPO / CHAPTERS["05"]
CONVERT = REPO / CHAPTERS["04"] / "convert_to_hf.py"
STEPS = ["--max-steps", "6", "--wandb-mode", "disabled"]
# The tiny chat set, chapter 05's default data: 128 tokens hold all but 5% of its conversations; an eval every 2 steps.
SFT = ["--seq-length", "128", "--eval-freq", "2"]


def pretrained_model(runs, env):
    """The "pretrained" model: the tiny model trained 40 steps by chapter 04 on 2 ranks, converted by its
    convert_to_hf.py into a Hugging Face folder (config, tokenizer, model.safetensors)."""
    _, experiment = runs.train("04", env, "--max-steps", "40", "--lr", "3e-3", "--wandb-mode", "disabled", nproc=2)
    model_dir = experiment / "hf-checkpoint-00000040"
    if not model_dir.exists():
        run([sys.executable, CONVERT, experiment], env, runs.workdir)
    return model_dir


def finetune(runs, env, *args):
    """Chapter 05 on 2 ranks, starting from the pretrained model, under tests/counting_run.py (helpers' counted())."""
    return runs.train("05", env, "-m", pretrained_model(runs, env), *STEPS, *SFT, *args, nproc=2,
                      launcher=[*torchrun(2), COUNTING_RUN])


# The start of the programs below: the chapter's script (the first argument) imported as the module `chapter`.
PREAMBLE = """
import importlib.util, json, sys
import torch

spec = importlib.util.spec_from_file_location("chapter", sys.argv[1])
chapter = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chapter)
"""


def run_program(program, env, cwd, *args, nproc=None):
    """Run one of the programs below, in a file of its own, as one process or under torchrun."""
    path = cwd / "program.py"
    path.write_text(program)
    launcher = [sys.executable] if nproc is None else torchrun(nproc)
    return run([*launcher, path, *args], env, cwd)


def last_json_line(result):
    return json.loads([line for line in result.stdout.splitlines() if line.startswith(("{", "["))][-1])


# What plain transformers computes on the rows of chapter 05's first step (its own data pipeline draws them): each
# example alone, labelled by transformers' own assistant mask (the bundled chat template with generation markers),
# the summed losses over the label count; for the folder loaded by from_pretrained(), and a random model.
TRANSFORMERS_LOSS = PREAMBLE + r"""
from transformers import AutoModelForCausalLM, AutoTokenizer

args = chapter.get_parser().parse_args(sys.argv[2:])
tokenizer = AutoTokenizer.from_pretrained(args.model_name)
turn = "{{ message['content'] }}{{ eos_token }}\n"
marked = tokenizer.chat_template.replace(turn, "{% if message['role'] == 'assistant' %}{% generation %}" + turn +
                                         "{% endgeneration %}{% else %}" + turn + "{% endif %}")
assert marked != tokenizer.chat_template
answers = {}
for line in open(f"{args.dataset_name}/train.jsonl"):
    messages = json.loads(line)["messages"]
    encoded = tokenizer.apply_chat_template(messages, chat_template=marked, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    assert encoded["input_ids"] == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False),
                                             add_special_tokens=False)["input_ids"]
    answers[tuple(encoded["input_ids"])] = encoded["assistant_masks"]
dataset, _, _ = chapter.load_and_tokenize_dataset(args, tokenizer)
examples = []
for rank in range(2):
    batch = next(iter(chapter.get_dataloader(dataset, args, 0, 0, torch.device("cpu"), rank, 2)))
    for input_ids, position_ids in zip(batch["input_ids"], batch["position_ids"]):
        starts = [*(position_ids == 0).nonzero().flatten().tolist(), len(position_ids)]
        examples += [input_ids[start:end].tolist() for start, end in zip(starts, starts[1:])]
found = [ids for ids in examples if tuple(ids) in answers]
assert len(examples) - len(found) <= 2 * args.batch_size, "more unknown examples than padded rows"

def loss_of(model):
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in found:
            labels = torch.tensor([token if answer else -100 for token, answer in zip(ids, answers[tuple(ids)])])
            logits = model.eval()(input_ids=torch.tensor([ids])).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, labels[1:], reduction="sum").item()
            count += int((labels[1:] != -100).sum())
    return total / count

pretrained = AutoModelForCausalLM.from_pretrained(args.model_name, dtype=torch.float32)
torch.manual_seed(0)
random_init = AutoModelForCausalLM.from_config(pretrained.config, dtype=torch.float32)
print(json.dumps({"pretrained": loss_of(pretrained), "random_init": loss_of(random_init), "examples": len(found)}))
"""


def test_pretrained_weights_give_the_loss_transformers_computes(runs, env, tmp_path):
    model_dir = pretrained_model(runs, env)
    result, experiment = finetune(runs, env)
    assert f"loaded the pretrained weights of {model_dir}" in result.stdout
    first_loss = read_losses(experiment)[0]
    reference = last_json_line(run_program(TRANSFORMERS_LOSS, env, tmp_path, script("05"), *FAST_ARGS, *SFT,
                                           "-m", model_dir, "-d", TINY_CHAT))
    print(f"\nfirst-step loss: chapter 05 from the pretrained folder {first_loss:.6f}, transformers on the answers of "
          f"{reference['examples']} examples alone {reference['pretrained']:.6f} (difference "
          f"{abs(first_loss - reference['pretrained']):.1e}); random init {reference['random_init']:.4f}")
    assert abs(first_loss - reference["pretrained"]) <= 1e-6
    assert first_loss < reference["random_init"] - 1.0


def test_a_tied_model_keeps_the_embedding_in_the_head_s_group_and_loads_its_one_matrix(runs, env, tmp_path,
                                                                                      tied_model):
    """With tie_word_embeddings the embedding is the head's parameter, so it joins the head's FSDP group instead of
    a group of its own. From the seed, the run trains chapter 01's curve with chapter 01's parameter count. From a
    tied Hugging Face folder, which stores the matrix once (as model.embed_tokens.weight), the first loss is the
    one transformers computes, and the checkpoint holds one matrix under both names."""
    reference_result, single = runs.train("01", env, "-m", tied_model, *STEPS, "--batch-size", "4")
    result, from_seed = runs.train("05", env, "-m", tied_model, *STEPS, "--batch-size", "2", *PLAIN_TEXT, nproc=2)
    difference = max_difference(read_losses(single), read_losses(from_seed))
    assert grad_norm_difference(single, from_seed, clipped=True) <= GRAD_NORM_TOLERANCE

    model_dir = tmp_path / "tied-pretrained"
    shutil.copytree(tied_model, model_dir)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tied_model), dtype=torch.float32).save_pretrained(
        model_dir)
    with safe_open(model_dir / "model.safetensors", framework="pt") as saved:
        assert "lm_head.weight" not in saved.keys()
    pretrained_result, finetuned = train("05", env, tmp_path, "-m", model_dir, *STEPS, *SFT, nproc=2)
    assert f"loaded the pretrained weights of {model_dir}" in pretrained_result.stdout
    first_loss = read_losses(finetuned)[0]
    reference = last_json_line(run_program(TRANSFORMERS_LOSS, env, tmp_path, script("05"), *FAST_ARGS, *SFT,
                                           "-m", model_dir, "-d", TINY_CHAT))
    weights = checkpoint_weights(finetuned / "checkpoint-00000006", tmp_path)
    head_vs_embedding = (weights["lm_head.weight"] - weights["model.embed_tokens.weight"]).abs().max().item()
    print(f"\ntied model: from the seed vs chapter 01, largest loss difference {difference:.1e} over 6 steps, "
          f"parameters {logged_parameter_count(result)} vs {logged_parameter_count(reference_result)}; from a tied "
          f"folder, first loss {first_loss:.6f} vs transformers {reference['pretrained']:.6f}; checkpoint's head vs "
          f"embedding {head_vs_embedding:.1e}")
    assert difference <= 1e-5
    assert logged_parameter_count(result) == logged_parameter_count(reference_result)
    assert abs(first_loss - reference["pretrained"]) <= 1e-5
    assert head_vs_embedding == 0


# Each rank loads the pretrained folder into its shards with the chapter's own functions, through the activation
# checkpoint wrapper (which renames the parameters), and compares every local shard with the slice of the
# safetensors file it should hold. FSDP shards dimension 0 the way torch.chunk() does.
SHARDS_EQUAL_SLICES = PREAMBLE + """
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from transformers import AutoConfig, AutoModelForCausalLM

model_dir = sys.argv[2]
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
chapter.apply_activation_checkpointing(model)
chapter.shard_model(model, init_device_mesh("cpu", (world_size,)), torch.float32, cpu_offload=False)
model.to_empty(device="cpu")
chapter.load_pretrained_weights(model, model_dir)
figures = {"rank": rank, "tensors": 0, "elements": 0, "total_elements": 0, "largest_difference": 0.0}
with safe_open(f"{model_dir}/model.safetensors", framework="pt") as weights:
    for name, param in get_model_state_dict(model).items():
        assert param.placements == (Shard(0),), (name, param.placements)
        full_rows = weights.get_slice(name).get_shape()[0]
        rows_per_rank = -(-full_rows // world_size)
        start, stop = min(rank * rows_per_rank, full_rows), min((rank + 1) * rows_per_rank, full_rows)
        expected = weights.get_slice(name)[start:stop]
        local = param.to_local()
        assert local.shape == expected.shape, (name, local.shape, expected.shape)
        figures["largest_difference"] = max(figures["largest_difference"], (local - expected).abs().max().item())
        figures["tensors"] += 1
        figures["elements"] += local.numel()
        figures["total_elements"] += param.numel()
every_rank = [None] * world_size
dist.all_gather_object(every_rank, figures)
if rank == 0:
    print(json.dumps(every_rank))
dist.destroy_process_group()
"""


@pytest.mark.quick
def test_from_the_seed_without_clipping_it_trains_chapter_01s_curve(runs, env, tied_model):
    """The tied model's parity run above, with clipping that binds at no step (NO_CLIPPING): the gradients are
    applied as computed, and their norm is chapter 01's at every step."""
    _, single = runs.train("01", env, "-m", tied_model, *STEPS, "--batch-size", "4", *NO_CLIPPING)
    _, from_seed = runs.train("05", env, "-m", tied_model, *STEPS, "--batch-size", "2", *PLAIN_TEXT, *NO_CLIPPING,
                              nproc=2)
    difference = max_difference(read_losses(single), read_losses(from_seed))
    norm_difference = grad_norm_difference(single, from_seed, clipped=False)
    print(f"\ntied model unclipped, 2 ranks x 2 vs chapter 01 batch 4: largest loss difference {difference:.1e}, "
          f"relative gradient norm difference {norm_difference:.1e} over 6 steps")
    assert difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE


def test_every_rank_holds_its_own_slices_of_the_safetensors(runs, env, tmp_path):
    model_dir = pretrained_model(runs, env)
    figures = last_json_line(run_program(SHARDS_EQUAL_SLICES, env, tmp_path, script("05"), model_dir, nproc=2))
    assert [record["rank"] for record in figures] == [0, 1]
    for record in figures:
        print(f"\nrank {record['rank']}: {record['tensors']} shards, {record['elements']:,} of "
              f"{record['total_elements']:,} elements, largest difference from the safetensors slices "
              f"{record['largest_difference']}")
        assert record["tensors"] == 39 and record["largest_difference"] == 0.0
        assert record["elements"] * 2 == record["total_elements"]


# The tensors autograd keeps from the forward pass for the backward pass (saved-tensor hooks, each storage counted
# once), and the FLOPs of forward plus backward, without and with the chapter's activation checkpointing. Inside a
# checkpointed layer the checkpoint's own hooks take over: what is counted is what stays in memory.
ACTIVATIONS_KEPT = PREAMBLE + """
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
input_ids = torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(0))
figures = {}
for checkpointing in [False, True]:
    with chapter.parameters_on_meta():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[2]), dtype=torch.float32)
    if checkpointing:
        chapter.apply_activation_checkpointing(model)
    chapter.shard_model(model, init_device_mesh("cpu", (1,)), torch.float32, cpu_offload=False)
    chapter.to_empty_keeping_buffers(model, torch.device("cpu"), cpu_offload=False)
    chapter.init_weights(model, 0)
    storages = {}

    def keep(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with FlopCounterMode(display=False) as flop_counter:
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
    figures[checkpointing] = {"loss": loss.item(), "saved_tensors": len(storages),
                              "saved_mb": sum(storages.values()) / 1e6, "gflops": flop_counter.get_total_flops() / 1e9}
print(json.dumps({"off": figures[False], "on": figures[True]}))
"""


def test_activation_checkpointing_keeps_fewer_activations_and_gives_the_same_losses(runs, env, tmp_path):
    eager_result, eager = finetune(runs, env)
    checkpointed_result, checkpointed = finetune(runs, env, "--activation-checkpointing")
    difference = max_difference(read_losses(eager), read_losses(checkpointed))
    # The positive control, counted in the runs themselves: with the option each layer's MLP runs forward twice.
    eager_counts, checkpointed_counts = counted(eager_result), counted(checkpointed_result)
    print(f"\nMLP forwards per rank over 6 steps: {eager_counts} without, {checkpointed_counts} with")
    assert sorted(eager_counts) == sorted(checkpointed_counts) == [0, 1]
    assert all(checkpointed_counts[rank]["mlp_forwards"] == 2 * eager_counts[rank]["mlp_forwards"] > 0
               for rank in eager_counts)
    figures = last_json_line(run_program(ACTIVATIONS_KEPT, env, tmp_path, script("05"), TINY_MODEL))
    off, on = figures["off"], figures["on"]
    print(f"\nactivation checkpointing: largest loss difference {difference:.1e} over 6 steps; kept for backward: "
          f"{off['saved_tensors']} tensors ({off['saved_mb']:.1f} MB) without, {on['saved_tensors']} "
          f"({on['saved_mb']:.1f} MB) with; forward + backward {off['gflops']:.2f} vs {on['gflops']:.2f} GFLOP")
    assert difference <= 1e-5
    assert on["loss"] == off["loss"]
    assert on["saved_tensors"] < off["saved_tensors"] / 2 and on["saved_mb"] < off["saved_mb"]
    # The recomputation: the layers' forward pass runs twice.
    assert on["gflops"] > off["gflops"] * 1.15
    # The checkpoint's parameter names are the model's own, without the wrapper's part.
    metadata = (checkpointed / "checkpoint-00000006" / ".metadata").read_bytes()
    assert b"model.layers.0.mlp.up_proj.weight" in metadata and b"_checkpoint_wrapped_module" not in metadata


def test_resume_is_exact_and_takes_precedence_over_the_pretrained_weights(runs, env, tmp_path):
    _, straight = finetune(runs, env)
    model_dir = pretrained_model(runs, env)
    args = ["-m", model_dir, *STEPS, *SFT]
    # The first half with activation checkpointing, the second without: the checkpoint's names do not depend on it.
    train("05", env, tmp_path, *args, "--exit-after-steps", "3", "--activation-checkpointing", nproc=2,
          experiment="resumed")
    result, resumed = train("05", env, tmp_path, *args, nproc=2, experiment="resumed")
    assert "resumed from" in result.stdout and "loaded the pretrained weights" not in result.stdout
    difference = max_difference(read_losses(straight), read_losses(resumed))
    eval_losses = [{record["step"]: record["eval_loss"] for record in read_metrics(experiment) if "eval_loss" in record}
                   for experiment in (straight, resumed)]
    eval_difference = max(abs(eval_losses[0][step] - eval_losses[1][step]) for step in eval_losses[0])
    weights = [final_weights(experiment, tmp_path / f"{experiment.name}.pt") for experiment in (straight, resumed)]
    weight_difference = max((weights[0][name] - weights[1][name]).abs().max().item() for name in weights[0])
    print(f"\nresume: 6 steps straight vs 3 + 3: largest loss difference {difference:.1e}, eval losses at steps "
          f"{sorted(eval_losses[0])} {eval_difference:.1e}, largest weight difference {weight_difference:.1e}")
    assert sorted(eval_losses[0]) == sorted(eval_losses[1]) == [2, 4, 6]
    assert difference <= 1e-6 and eval_difference <= 1e-6 and weight_difference <= 1e-6
    assert grad_norm_difference(straight, resumed, clipped=None) <= 1e-6


def final_weights(experiment, path):
    """The weights of an experiment's step-6 checkpoint, read by torch's own DCP converter."""
    dcp_to_torch_save(experiment / "checkpoint-00000006", path)
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


BAD_INPUTS = {
    "cpu offload": (["--cpu-offload"], "error: --cpu-offload", "needs CUDA"),
    "flash attention": (["--attn-implementation", "flash_attention_2"], "error: --attn-implementation",
                        "needs CUDA and `pip install flash-attn`"),
    "hub model offline": (["-m", "meta-llama/Llama-3.1-405B"], "error: cannot load -m meta-llama/Llama-3.1-405B",
                          "; pass a hub name or a model folder"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_what_this_machine_cannot_do_gets_a_one_line_error(env, tmp_path, case):
    args, start, expected = BAD_INPUTS[case]
    result, _ = train("05", env, tmp_path, *args, "--max-steps", "2", check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result).startswith(start) and expected in error_line(result), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_folder_without_one_of_the_weights_gets_a_one_line_error(runs, env, tmp_path):
    model_dir = tmp_path / "incomplete-model"
    shutil.copytree(pretrained_model(runs, env), model_dir)
    weights = load_file(model_dir / "model.safetensors")
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    result, _ = train("05", env, tmp_path, "-m", model_dir, "--max-steps", "2", check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result) == (
        f"error: cannot load the weights of {model_dir} (Missing key in checkpoint state_dict: "
        "model.layers.2.mlp.up_proj.weight.); its *.safetensors must hold every weight its config.json describes"), \
        result.stderr[-2000:]
    assert "Traceback" not in result.stderr



def test_flash_attention_at_batch_size_1_reads_nothing_on_the_host_in_the_layers(monkeypatch, fake_flash_attention):
    """transformers' flash-attention path, at batch size 1, checks position_ids for packed sequences in every layer
    (_is_packed_sequence), a host read: a sync per layer on a GPU. With the chapter's get_attention_kwargs() it does
    not check, and computes the same loss as SDPA, at batch size 1 and 4. Run with flash-attn's functions computed by
    SDPA on the CPU (FakeFlashAttention); the GPU check runs the real ones."""
    import transformers.modeling_flash_attention_utils as flash_utils

    fake = fake_flash_attention
    packed_checks, host_reads = [], []
    is_packed_sequence, tensor_bool = flash_utils._is_packed_sequence, torch.Tensor.__bool__
    monkeypatch.setattr(flash_utils, "_is_packed_sequence",
                        lambda *args, **kwargs: packed_checks.append(args) or is_packed_sequence(*args, **kwargs))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda tensor: host_reads.append(1) or tensor_bool(tensor))
    chapter = load_script("05")
    config = AutoConfig.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    num_layers = config.num_hidden_layers

    def forward(input_ids, attn_implementation, **kwargs):
        model.config._attn_implementation = attn_implementation
        packed_checks.clear(), host_reads.clear()
        with torch.no_grad():
            loss = model(input_ids=input_ids, labels=input_ids, use_cache=False, **kwargs).loss.item()
        return loss, len(packed_checks), len(host_reads)

    figures = {}
    for batch_size in (1, 4):
        input_ids = torch.randint(0, config.vocab_size, (batch_size, 64), generator=torch.Generator().manual_seed(0))
        sdpa_loss, _, sdpa_reads = forward(input_ids, "sdpa")
        kwargs = chapter.get_attention_kwargs("flash_attention_2", input_ids)
        flash_loss, checks, reads = forward(input_ids, "flash_attention_2", **kwargs)
        assert checks == 0, f"batch size {batch_size}: the packed-sequence check ran {checks} times"
        assert abs(flash_loss - sdpa_loss) <= 1e-5, (batch_size, flash_loss, sdpa_loss)
        # NOTE: what is left is outside the layers, as with SDPA: the mask creation reads position_ids once per
        # forward.
        assert reads == sdpa_reads, (batch_size, reads, sdpa_reads)
        figures[batch_size] = (reads, abs(flash_loss - sdpa_loss))
    assert fake.calls == {"flash_attn_func": 0, "flash_attn_varlen_func": 2 * num_layers}
    assert chapter.get_attention_kwargs("sdpa", input_ids) == {} == chapter.get_attention_kwargs("eager", input_ids)

    # Without the kwargs, as before: the check, and its host read, in every layer at batch size 1.
    input_ids = input_ids[:1]
    _, checks_before, reads_before = forward(input_ids, "flash_attention_2")
    print(f"\nflash attention at batch size 1: host reads per forward {reads_before} without the chapter's kwargs "
          f"({checks_before} packed-sequence checks, one per layer), {figures[1][0]} with them (0 checks); loss vs "
          f"SDPA {figures[1][1]:.1e} at batch size 1, {figures[4][1]:.1e} at 4")
    assert checks_before == num_layers
    assert reads_before - figures[1][0] == num_layers
    # The chapter passes them to its model.
    chapter_inputs = chapter.get_model_inputs({"input_ids": input_ids}, "flash_attention_2", torch.float32,
                                              torch.device("cpu"))
    assert chapter_inputs.keys() == {"input_ids", "labels", *kwargs}
    assert "loss = model(**inputs, num_items_in_batch=num_label_tokens, use_cache=False).loss" in script("05").read_text()


def test_a_folder_with_only_pickled_weights_gets_a_one_line_error(env, tmp_path):
    # The tiny model's config and tokenizer, with its weights saved by torch.save() as older hub models have them.
    model_dir = tmp_path / "pickled-model"
    shutil.copytree(TINY_MODEL, model_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float32)
    torch.save(model.state_dict(), model_dir / "pytorch_model.bin")
    result, _ = train("05", env, tmp_path, "-m", model_dir, "--max-steps", "2", check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result) == (
        f"error: {model_dir} holds only pickled weights (pytorch_model.bin); write them as safetensors with "
        "transformers' save_pretrained() and pass -m that folder"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_mistral_consolidated_safetensors_are_neither_read_nor_downloaded(runs, env, tmp_path):
    """A folder as Mistral's repositories are: the Hugging Face weights in model-*.safetensors, and the same weights
    again, in Mistral's format, in consolidated.safetensors. Here that second file is not even a safetensors file:
    the run trains exactly like the fine-tune from the plain folder only if nothing ever opens it."""
    model_dir = tmp_path / "mistral-like"
    shutil.copytree(pretrained_model(runs, env), model_dir)
    (model_dir / "model.safetensors").rename(model_dir / "model-00001-of-00001.safetensors")
    (model_dir / "consolidated.safetensors").write_bytes(b"Mistral's own format, which train_llm.py must not open")
    chapter = load_script("05")
    assert chapter.find_weight_files(model_dir) == [model_dir / "model-00001-of-00001.safetensors"]
    assert any(fnmatch.fnmatch("consolidated.safetensors", pattern) for pattern in chapter.SKIPPED_MODEL_FILES)
    _, plain = finetune(runs, env)
    result, experiment = train("05", env, tmp_path, "-m", model_dir, *STEPS, *SFT, nproc=2,
                               experiment="mistral-like")
    assert f"loaded the pretrained weights of {model_dir}" in result.stdout
    difference = max_difference(read_losses(plain), read_losses(experiment))
    print(f"\nmodel-00001-of-00001.safetensors next to an unreadable consolidated.safetensors: largest loss "
          f"difference from the plain folder's fine-tune {difference:.1e} over 6 steps")
    assert difference <= 1e-6


def fake_command(tmp_path, name, body='printf "%s\\n" "$*"'):
    """An executable that runs body (by default: print its arguments) and appends the output to tmp_path/NAME.calls."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!/bin/bash\n{{\n{body}\n}} >> {tmp_path / name}.calls\n")
    path.chmod(0o755)
    return path


# What launch-ssh.sh asks each host to do, run here with a tmux that prints the command its session would run.
FAKE_SSH = """host=$1; shift
tmux() { if [ "$1" = has-session ]; then return 1; fi; echo "$host: ${*: -1}"; }
eval "$*"
"""


def test_launch_starts_chapter_05_on_every_host_with_the_environment_of_a_405b_run(env, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# two nodes\nnode-a slots=8\nnode-b slots=8\n")
    # The test's own OMP_NUM_THREADS and HF_HUB_OFFLINE left out, to see launch.sh's defaults.
    launch_env = {name: value for name, value in env.items() if name not in ("OMP_NUM_THREADS", "HF_HUB_OFFLINE")}
    launch_env.update(SSH=str(fake_command(tmp_path, "ssh", FAKE_SSH)), TORCHRUN="/opt/venv/bin/torchrun")
    run(["bash", CHAPTER / "launch.sh", hosts, "-m", "/shared/Llama-3.1-405B", "-e", "llama-405b"], launch_env,
        tmp_path)
    calls = (tmp_path / "ssh.calls").read_text().splitlines()
    assert [call.split(":")[0] for call in calls] == ["node-a", "node-b"]
    for call in calls:
        assert "/opt/venv/bin/torchrun --nnodes 2 --nproc-per-node 8 " in call
        assert f"{script('05')} -m /shared/Llama-3.1-405B -e llama-405b" in call
        for variable in ["PYTORCH_ALLOC_CONF=expandable_segments:True", "OMP_NUM_THREADS=16", "HF_HUB_OFFLINE=1"]:
            assert f" {variable} " in call, call


def test_download_fetches_only_the_weights_config_and_tokenizer(env, tmp_path):
    fake_command(tmp_path, "hf")
    download_env = {**env, "PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}"}
    run(["bash", CHAPTER / "download.sh", "meta-llama/Llama-3.1-405B", tmp_path / "models"], download_env, tmp_path)
    call = (tmp_path / "hf.calls").read_text().strip()
    assert call.startswith(f"download meta-llama/Llama-3.1-405B --local-dir {tmp_path / 'models' / 'Llama-3.1-405B'}")
    # The same files the script itself fetches when -m is a hub name.
    chapter = load_script("05")
    assert re.findall(r"--include (\S+)", call) == chapter.MODEL_FILES
    assert re.findall(r"--exclude (\S+)", call) == chapter.SKIPPED_MODEL_FILES


# Fine-tuning data: schemas, masking, packing, the loss per token, evaluation.


def conversations(count):
    return [json.loads(line)["messages"] for line in (TINY_CHAT / "train.jsonl").read_text().splitlines()[:count]]


@pytest.mark.quick
def test_each_schema_labels_its_answers_and_nothing_else():
    """The same exchanges in each schema of Hugging Face's conventions: the labelled tokens decode to the answers
    (with the end of turn), every other token is -100; find_schema() picks each from its columns."""
    from transformers import AutoTokenizer

    chapter = load_script("05")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    eos = tokenizer.eos_token
    first = next(messages for messages in conversations(50) if [m["role"] for m in messages] == ["user", "assistant"])
    question, answer = first[0]["content"], first[1]["content"]
    cases = {
        "messages": ({"messages": first}, [f"{answer}{eos}\n"]),
        "prompt-completion": ({"prompt": question, "completion": answer}, [f"{answer}{eos}"]),
        "alpaca": ({"instruction": question, "input": "", "output": answer}, [f"{answer}{eos}"]),
        "alpaca with input": ({"instruction": "Answer.", "input": question, "output": answer}, [f"{answer}{eos}"]),
    }
    multi_turn = next(messages for messages in conversations(200) if len(messages) >= 4)
    cases["messages, system and two exchanges"] = ({"messages": multi_turn}, [
        f"{message['content']}{eos}\n" for message in multi_turn if message["role"] == "assistant"])
    for name, (example, expected) in cases.items():
        schema = chapter.find_schema(datasets.Dataset.from_list([example]), "text")
        assert schema == name.split(",")[0].split(" with")[0], (name, schema)
        input_ids, labels = chapter.tokenize_example(example, schema, tokenizer)
        assert len(input_ids) == len(labels)
        spans, span = [], []
        for token, label in zip(input_ids, labels):
            if label != -100:
                assert label == token
                span.append(token)
            elif span:
                spans, span = spans + [span], []
        spans += [span] if span else []
        decoded = [tokenizer.decode(span) for span in spans]
        print(f"\n{name}: {sum(label != -100 for label in labels)} of {len(labels)} tokens labelled: {decoded}")
        assert decoded == expected, (name, decoded)
    assert chapter.find_schema(datasets.Dataset.from_list([{"text": "plain"}]), "text") == "text"


# A packed row's summed loss against its examples' run one at a time, with each attention implementation (flash
# attention's functions computed by SDPA on the CPU: the fake_flash_attention fixture), and the row without the mask.
# NOTE: in float64: in float32, adding ~1,000 nats in another order moves the mean by ~1e-6 whatever the attention.
def test_a_packed_row_s_loss_is_its_examples_losses_each_run_alone(fake_flash_attention):
    from transformers import AutoTokenizer

    fake = fake_flash_attention
    chapter = load_script("05")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    examples = [chapter.tokenize_example({"messages": messages}, "messages", tokenizer)
                for messages in conversations(6)]
    rows = chapter.pack_examples([ids for ids, _ in examples], [labels for _, labels in examples], 256,
                                 tokenizer.eos_token_id)
    row = {name: torch.tensor(values[:1]) for name, values in rows.items()}
    in_row = (row["position_ids"][0] == 0).sum().item() - 1  # the last "example" is the padding
    assert in_row >= 3, in_row
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), dtype=torch.float64).eval()

    def summed_loss(attn_implementation, **inputs):
        model.config._attn_implementation = attn_implementation
        with torch.no_grad():
            return model(**inputs, num_items_in_batch=1, use_cache=False).loss.item()

    alone = sum(summed_loss("sdpa", input_ids=torch.tensor([ids]), labels=torch.tensor([[-100, *labels[1:]]]))
                for ids, labels in examples[:in_row])
    num_labels = (row["labels"][:, 1:] != -100).sum().item()
    differences = {}
    for attn_implementation in ["sdpa", "eager", "flash_attention_2"]:
        inputs = chapter.get_model_inputs(row, attn_implementation, torch.float64, torch.device("cpu"))
        differences[attn_implementation] = abs(summed_loss(attn_implementation, **inputs) - alone) / num_labels
    unmasked = abs(summed_loss("sdpa", input_ids=row["input_ids"], labels=row["labels"]) - alone) / num_labels
    print(f"\na row of {in_row} packed examples ({num_labels} labels) vs each alone, loss per label token: "
          + ", ".join(f"{name} {difference:.1e}" for name, difference in differences.items())
          + f"; one causal sequence at positions 0..255 instead: {unmasked:.2f}")
    assert all(difference <= 1e-12 for difference in differences.values()), differences
    assert fake.calls["flash_attn_varlen_func"] == model.config.num_hidden_layers
    # The positive control: without per-example positions and attention, the examples see each other.
    assert unmasked > 1e-2


# The mean of means the chapter replaced, put back into a copy of it: each micro-batch's mean loss, averaged.
MEAN_OF_MEANS = ("loss = model(**inputs, num_items_in_batch=num_label_tokens, use_cache=False).loss",
                 "loss = model(**inputs, use_cache=False).loss / (args.grad_accum * world_size)")
# (processes, flags): layouts of the reference's global batch of 4 rows.
EXACT_LAYOUTS = {"dp 2 x grad-accum 2": (2, ["--batch-size", "1", "--grad-accum", "2"]),
                 "dp 4": (4, ["--batch-size", "1"]),
                 "1 process x grad-accum 4": (None, ["--batch-size", "1", "--grad-accum", "4"])}


def test_the_loss_per_token_of_the_global_batch_is_the_same_at_every_layout(runs, env, tmp_path):
    """On the tiny chat set, whose steps hold 37 to 74 labelled tokens: every layout of a global batch of 4 rows
    trains the curve of one process on all 4, where a mean of per-micro-batch means does not.

    NOTE: at a fine-tuning learning rate: at 1e-3 AdamW's first, sign-like steps turn the gradients' rounding (FSDP
    adds the ranks' in another order) into norms 2.8e-4 apart by step 6, at 1e-4 into 1.2e-4."""
    args = [*STEPS, "--seq-length", "128", "--lr", "1e-4"]
    _, reference = runs.train("05", env, *args, "--batch-size", "4")
    label_counts = [record["label_tokens"] for record in read_metrics(reference)]
    figures = {}
    for name, (nproc, flags) in EXACT_LAYOUTS.items():
        _, experiment = runs.train("05", env, *args, *flags, nproc=nproc)
        figures[name] = (max_difference(read_losses(reference), read_losses(experiment)),
                         grad_norm_difference(reference, experiment, clipped=True))
    mean_of_means = tmp_path / "05-mean-of-means" / "train_llm.py"
    mean_of_means.parent.mkdir()
    source = script("05").read_text()
    assert source.count(MEAN_OF_MEANS[0]) == 1
    mean_of_means.write_text(source.replace(*MEAN_OF_MEANS))
    result = run([*torchrun(2), mean_of_means, *FAST_ARGS, *args, "--batch-size", "1", "--grad-accum", "2",
                  "-m", TINY_MODEL, "-d", TINY_CHAT, "--save-dir", tmp_path / "outputs", "-e", "mean-of-means"], env,
                 tmp_path)
    wrong = tmp_path / "outputs" / "mean-of-means"
    wrong_figures = (max_difference(read_losses(reference), read_losses(wrong)),
                     grad_norm_difference(reference, wrong, clipped=True))
    print(f"\nlabel tokens per step {label_counts}; vs 1 process on the global batch, largest loss and relative "
          "gradient norm differences over 6 steps: " + ", ".join(
              f"{name} {loss:.1e} / {norm:.1e}" for name, (loss, norm) in figures.items())
          + f"; a mean of means at dp 2 x grad-accum 2: {wrong_figures[0]:.1e} / {wrong_figures[1]:.1e}")
    assert len(set(label_counts)) > 1
    assert all(loss <= 1e-5 and norm <= GRAD_NORM_TOLERANCE for loss, norm in figures.values()), figures
    assert "loss" in result.stdout and wrong_figures[0] > 1e-3 and wrong_figures[1] > GRAD_NORM_TOLERANCE


SFT_BAD_INPUTS = {
    "no schema": (lambda tmp_path: ["-d", write_jsonl(tmp_path / "qa.jsonl", [{"question": "Who?", "answer": "I."}])],
                  "error: no known columns (columns: {'question': 'string', 'answer': 'string'}); pass messages, "
                  "prompt + completion, instruction + output (alpaca) or a text column (--text-column)"),
    "no chat template": (lambda tmp_path: ["-m", model_without_chat_template(tmp_path)],
                         "error: -d has messages, but -m {tmp_path}/no-chat-template has no chat template; use a "
                         "model that has one (an Instruct model), or prompt + completion columns"),
    "all too long": (lambda tmp_path: ["--seq-length", "16"],
                     "error: all 570 examples are longer than --seq-length 16; raise it"),
    "empty file": (lambda tmp_path: ["-d", write_jsonl(tmp_path / "empty.jsonl", [])],
                   "error: cannot load -d {tmp_path}/empty.jsonl (it holds no data); pass a hub name, or .jsonl "
                   ".json .csv .txt .parquet"),
    # NOTE: a file's split name is a label only: the "held-out" data would be the training data.
    "eval split of a file": (lambda tmp_path: ["--eval-split", "test", "-d", TINY_CHAT / "train.jsonl"],
                             "error: --eval-split test: a file has one split, the one trained on; use --eval-fraction, "
                             "or -d a folder or hub data set with that split"),
    # NOTE: TRL's conversational prompt-completion: turns where the tokenizer takes text.
    "turns as prompt and completion": (
        lambda tmp_path: ["-d", write_jsonl(tmp_path / "turns.jsonl", [
            {"prompt": [{"role": "user", "content": "Who?"}], "completion": [{"role": "assistant", "content": "I."}]}])],
        "error: -d's prompt and completion columns are not plain text (columns: {'prompt': 'nested', 'completion': "
        "'nested'}); for chat turns, pass them as one messages column"),
}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.mark.parametrize("case", SFT_BAD_INPUTS)
def test_fine_tuning_data_it_cannot_use_gets_a_one_line_error(env, tmp_path, case):
    make_args, expected = SFT_BAD_INPUTS[case]
    result, _ = train("05", env, tmp_path, *make_args(tmp_path), "--max-steps", "2", check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result) == expected.replace("{tmp_path}", str(tmp_path)), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_text_too_small_to_hold_out_a_sequence_trains_without_evaluation_and_says_so(env, tmp_path):
    """40 short lines: --eval-fraction's 2 of them make no sequence of --seq-length tokens (datasets once saved that
    empty split as no files, and load_from_disk failed with an IndexError)."""
    texts = [json.loads(line)["text"][:60] for line in (TINY_CORPUS / "train.jsonl").read_text().splitlines()[:40]]
    (tmp_path / "small.txt").write_text("".join(text.replace("\n", " ") + "\n" for text in texts))
    result, experiment = train("05", env, tmp_path, "-d", tmp_path / "small.txt", "--max-steps", "2",
                               "--batch-size", "1")
    assert "WARNING --eval-fraction 0.05 holds out under --seq-length tokens: no evaluation" in result.stdout
    assert [record["step"] for record in read_metrics(experiment)] == [1, 2]


def test_the_readme_s_chat_command_answers_from_the_fine_tuned_checkpoint(runs, env, tmp_path):
    """The README's generate.py --chat command, as written, from a folder holding a fine-tune (the shared one) where
    the quick start writes its experiment."""
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", (CHAPTER / "README.md").read_text(), re.DOTALL)
    (command,) = [block for block in blocks if "tools/generate.py" in block]
    words = shlex.split(command)
    assert words[:4] == ["python", "tools/generate.py", f"outputs/{CHAPTERS['05']}", "--chat"], words
    _, experiment = finetune(runs, env)
    shutil.copytree(experiment, tmp_path / "outputs" / CHAPTERS["05"])
    result = run([sys.executable, REPO / "tools" / "generate.py", *words[2:], "--max-new-tokens", "8"], env, tmp_path)
    assert "checkpoint-00000006" in result.stderr and result.stdout.strip()
    assert "Which play" not in result.stdout, "the answer only, not the prompt"


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("05", runs, env, family_models)
