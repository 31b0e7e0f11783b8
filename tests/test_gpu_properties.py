"""What a GPU would show, checked on the CPU for every chapter: host synchronizations and the precision of every
matmul, per training step, counted by tools/measure_step.py (a TorchDispatchMode that sees every operator).

* A host synchronization (.item(), bool(tensor), nonzero, .tolist(), ...) makes the CPU wait for the GPU to finish
  everything queued: the GPU then idles while the CPU queues the next kernels. A step that neither logs nor follows
  a logging step must have none. Step 1 is excluded: it builds the optimizer's state and the pipeline's metadata.
* A blocking host collective (a gloo all-reduce the script waits for, a barrier) makes every host wait for every
  other host: no host runs ahead of its GPU, and the wait grows with the ranks. Steps 2-4 (they neither log nor
  save) must have none.
* Under --dtype bfloat16 every matmul of a step (forward and backward, SDPA included) must take bf16 inputs: an fp32
  matmul on a GPU runs on CUDA cores at a fifteenth of the tensor cores' speed, and holds twice the bytes.

* tokens/s counts each token a step trains once: not once per tensor-, context- or pipeline-parallel rank that
  shares it (tools/measure_step.py times each step from outside).

Each chapter runs 5 steps under --dtype bfloat16, logging only after step 5, in a layout that exercises its
parallelism at the least cost.
"""

import sys
from collections import defaultdict

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import (CHAPTERS, FAST_ARGS, REPO, TINY_MODEL, load_script, read_metrics, run, script,
                     torchrun, train)

sys.path.insert(0, str(REPO / "tools"))
from measure_step import make_dispatch_mode, read_measurements, StepMeter  # noqa: E402

MEASURE = REPO / "tools" / "measure_step.py"
STEPS = 5
ARGS = ["--max-steps", str(STEPS), "--log-freq", str(STEPS), "--batch-size", "2", "--dtype", "bfloat16",
        "--wandb-mode", "disabled"]

# name: (chapter, processes (None: one plain process), the chapter's flags)
CASES = {
    "01": ("01", None, []),
    "02 dp2 zero1": ("02", 2, ["--zero1"]),
    "03 dp2": ("03", 2, []),  # NOTE: chapter 02's step with plain DDP (no --zero1), started by torchrun
    "04 dp2": ("04", 2, []),
    "05 checkpointing": ("05", None, ["--activation-checkpointing"]),
    "06 tp2": ("06", 2, []),
    "07 tp2 dp1": ("07", 2, ["--tp", "2"]),
    "08 pp2 4 micro-batches": ("08", 2, ["--pp", "2", "--batch-size", "4", "--pp-microbatches", "4"]),
    "09 cp2 ring": ("09", 2, ["--cp", "2", "--cp-attention", "ring"]),
    "10 ep2": ("10", 2, ["--ep", "2"]),
    # NOTE: tensor-parallel stages: sequence-sharded local activations cross between stages, the vocab-parallel loss
    # inside the schedule.
    "11 tp2 pp2": ("11", 4, ["--tp", "2", "--pp", "2"]),
}
# NOTE: the ranks that train on different sequences (tp, cp and pp ranks share theirs): a step trains batch x seq x
# this many tokens, whatever the world size.
DATA_PARALLEL = {"02 dp2 zero1": 2, "03 dp2": 2, "04 dp2": 2, "10 ep2": 2}
# NOTE: the deliberate fp32 inputs of a matmul under --dtype bfloat16, with their reason: SDPA's backward takes the
# forward's log-sum-exp, which FlashAttention keeps in fp32 (its sixth input, before any mask: chapter 05's packed
# rows), as every fused attention kernel does.
FP32_INPUTS_ALLOWED = {"aten::_scaled_dot_product_flash_attention_for_cpu_backward": [5]}


def host_syncs_allowed(name):
    """{"OPERATOR at FILE:LINE": calls per step} of the deliberate host synchronizations of a case, with their reason.

    Chapter 10's all-to-all of tokens has uneven split sizes, which NCCL takes as host integers: each MoE layer's
    forward reads them from the device once (torchtitan's expert parallelism does too; the backward reuses them).
    One per MoE layer per micro-batch (every layer of the tiny model, one micro-batch), at that one line.
    """
    if not name.startswith("10 "):
        return {}
    lines = script("10").read_text().splitlines()
    at = [number for number, line in enumerate(lines, 1) if line.rstrip().endswith(".long().tolist()")]
    assert len(at) == 1, at
    moe_layers = AutoConfig.from_pretrained(REPO / "data" / "tiny-qwen3-moe").num_hidden_layers
    return {f"Tensor.tolist at {CHAPTERS['10']}/train_llm.py:{at[0]}": moe_layers}


def not_bf16(key):
    """Whether a "matmuls" key of tools/measure_step.py, OPERATOR(dtype, ...), has a floating input not in bf16."""
    name, dtypes = key[:-1].split("(")
    dtypes = dtypes.split(", ")
    for index in FP32_INPUTS_ALLOWED.get(name, []):
        dtypes[index] = "bfloat16" if dtypes[index] == "float32" else dtypes[index]
    return any(dtype.startswith("float") for dtype in dtypes)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu-properties")


@pytest.mark.parametrize("name", CASES)
def test_a_step_has_no_host_sync_only_bf16_matmuls_and_counts_each_token_once(env, workdir, name):
    chapter, nproc, args = CASES[name]
    out_dir = workdir / name.replace(" ", "-")
    launcher = [sys.executable] if nproc is None else torchrun(nproc)
    _, experiment = train(chapter, env, workdir, *ARGS, *args, nproc=nproc, experiment=name.replace(" ", "-"),
                          launcher=[*launcher, MEASURE, "--out", out_dir], timeout=300)
    for rank, measurement in sorted(read_measurements(out_dir).items()):
        steps = measurement["steps"]
        assert [step["step"] for step in steps] == list(range(1, STEPS + 1)), (name, rank)
        syncs = {step["step"]: step["host_syncs"] for step in steps[1:]}
        print(f"\n{name} rank {rank}: host syncs per step {[sum(s.values()) for s in syncs.values()]} (steps 2-5), "
              f"step 1 {steps[0]['host_syncs']}, between steps {measurement['host_syncs_between_steps']}")
        allowed = host_syncs_allowed(name)
        assert all(s == allowed for s in syncs.values()), (f"{name} rank {rank}: host syncs in steps 2-{STEPS}: "
                                                           f"{syncs}, allowed {allowed}")
        waits = {step["step"]: step["blocking_host_collectives"] for step in steps[1:-1]}
        assert not any(waits.values()), f"{name} rank {rank}: blocking host collectives in steps 2-{STEPS - 1}: {waits}"
        for step in steps:
            other = {key: calls for key, calls in step["matmuls"].items() if not_bf16(key)}
            assert step["matmuls"] and not other, f"{name} rank {rank} step {step['step']}: {other}"
    # NOTE: tokens/s x the steps' own seconds gives the tokens the steps trained, a little less (tokens/s's seconds
    # also hold the time between steps); counting every rank's tokens would give the world size / dp times as many.
    (record,) = read_metrics(experiment)
    flags = [*FAST_ARGS, *ARGS, *args]
    last = {flag: int(flags[index + 1]) for index, flag in enumerate(flags) if flag in ("--batch-size", "--seq-length")}
    tokens = STEPS * last["--batch-size"] * last["--seq-length"] * DATA_PARALLEL.get(name, 1)
    fraction = record["tokens_per_second"] * sum(step["seconds"] for step in read_measurements(out_dir)[0]["steps"])
    print(f"{name}: tokens/s x the steps' seconds / the {tokens} tokens trained = {fraction / tokens:.2f}")
    assert 0.5 < fraction / tokens <= 1.0, fraction / tokens


@pytest.mark.quick
def test_every_chapter_has_a_case():
    assert sorted({chapter for chapter, _, _ in CASES.values()}) == sorted(CHAPTERS)


def test_the_flash_attention_path_syncs_only_in_transformers_mask_creation(monkeypatch, fake_flash_attention):
    """transformers' flash-attention path, with flash-attn's functions computed by SDPA on the CPU (as in test_05),
    through chapter 05's attention_implementation() and get_attention_kwargs() (the chapter of the attention options):
    a forward and backward at batch size 1 and 2 give SDPA's loss, SDPA with no host sync, and flash attention with
    exactly one per forward, in transformers' mask creation.

    NOTE: transformers picks the flash kernel by the implementation's name, which also names its mask function, and
    that reads position_ids on the host (masking_utils.find_packed_sequence_indices): no name or input skips it.
    """
    fake = fake_flash_attention
    config = AutoConfig.from_pretrained(TINY_MODEL)
    chapter = load_script("05")
    torch.manual_seed(0)
    # NOTE: built with SDPA (from_config refuses flash_attention_2 without flash-attn), then switched per forward.
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    losses, syncs = {}, {}
    for attn_implementation in ("sdpa", "flash_attention_2"):
        model.config._attn_implementation = chapter.attention_implementation(config, 64, attn_implementation)
        for batch_size in (1, 2):
            input_ids = torch.randint(0, config.vocab_size, (batch_size, 64),
                                      generator=torch.Generator().manual_seed(batch_size))
            kwargs = chapter.get_attention_kwargs(attn_implementation, input_ids)
            meter = StepMeter(None)
            meter.current = {"host_syncs": defaultdict(int), "matmuls": defaultdict(int), "in_forward_backward": False}
            with make_dispatch_mode(meter):
                loss = model(input_ids=input_ids, labels=input_ids, use_cache=False, **kwargs).loss
                loss.backward()
            model.zero_grad(set_to_none=True)
            syncs[attn_implementation, batch_size] = dict(meter.current["host_syncs"])
            losses[attn_implementation, batch_size] = loss.item()
    for batch_size in (1, 2):
        assert syncs["sdpa", batch_size] == {}, (batch_size, syncs["sdpa", batch_size])
        flash_syncs = syncs["flash_attention_2", batch_size]
        assert sum(flash_syncs.values()) == 1 and all("masking_utils.py" in key for key in flash_syncs), flash_syncs
        assert abs(losses["sdpa", batch_size] - losses["flash_attention_2", batch_size]) <= 1e-5, losses
    assert fake.calls["flash_attn_func"] == 0 and fake.calls["flash_attn_varlen_func"] == 2 * config.num_hidden_layers


def test_a_degree_of_1_wraps_nothing(env, tmp_path):
    """07 at --tp 1 and 11 with tp, pp and cp of 1 run chapter 04's step: in step 2 of one process,
    dev/count_host_ops.py counts their operators with a DTensor argument (sharding propagation, host time on a GPU):
    07's are 04's (FSDP's few), 11's no more (07 at --tp 1 dispatched 636 when it wrapped every weight)."""
    import json

    counted = {}
    for name, flags in [("04", []), ("07", ["--tp", "1"]), ("11", ["--tp", "1", "--pp", "1", "--cp", "1"])]:
        out = tmp_path / name
        run([sys.executable, REPO / "dev" / "count_host_ops.py", "--out", out, script(name), *FAST_ARGS, *flags,
             "--max-steps", "2", "--seq-length", "32", "--batch-size", "2", "--wandb-mode", "disabled",
             "--save-dir", tmp_path / "outputs", "-e", name], env, tmp_path)
        steps = json.loads((out / "rank-0.json").read_text())["steps"][1:]
        counted[name] = max(step["dtensor"] for step in steps)
    print(f"\noperators with a DTensor argument per step at degree 1: {counted}")
    assert 0 < counted["04"] == counted["07"] and counted["11"] <= counted["04"], counted
