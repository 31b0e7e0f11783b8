"""tools/estimate_memory.py against what the chapters' scripts really hold and send, measured by tools/measure_step.py
(which runs a chapter unchanged, counting every collective and every tensor): parameters, gradients and optimizer
state to the byte, per rank, at world sizes 1, 2 and 4, on the bundled tiny Llama and on a tiny Qwen2 (biases, and a
hidden size of 130 that FSDP cannot split evenly over 4 ranks), FSDP in bf16 and with gradient accumulation too; the
bytes DDP, FSDP and tensor parallelism send per step against the textbook formulas and the estimate, within 1%,
pipeline (08) and ring-attention (09) sends included; the peak of a step's activations and transient buffers within
15% (bf16's is open: BF16_PEAK_OPEN).

Every run trains one step of 2 sequences of 64 tokens, once per module. To check a new chapter, add its layouts to
CASES: the chapter, the processes, the model, its flags, and the estimator's flags for the same layout.
"""

import json
import shutil
import sys

import pytest

from helpers import REPO, TINY_MODEL, memory_held, torchrun, train

sys.path.insert(0, str(REPO / "tools"))
import estimate_memory  # noqa: E402
from measure_step import read_measurements  # noqa: E402

MEASURE = REPO / "tools" / "measure_step.py"
ONE_STEP = ["--max-steps", "1", "--batch-size", "2", "--wandb-mode", "disabled"]
TOKENS = 2 * 64  # a micro-batch of ONE_STEP with FAST_ARGS' --seq-length 64

# name: (chapter, processes (None: one plain process), model, the chapter's flags, the estimator's layout)
CASES = {
    "01 llama": ("01", None, "llama", [], {}),
    "01 qwen2": ("01", None, "qwen2", [], {}),
    "02 zero1 llama ws2": ("02", 2, "llama", ["--zero1"], {"dp": 2, "zero1": True}),
    "02 zero1 qwen2 ws4": ("02", 4, "qwen2", ["--zero1"], {"dp": 4, "zero1": True}),
    "04 llama ws2": ("04", 2, "llama", [], {"dp": 2, "fsdp": True}),
    "04 qwen2 ws4": ("04", 4, "qwen2", [], {"dp": 4, "fsdp": True}),
    "04 llama ws2 bf16": ("04", 2, "llama", ["--dtype", "bfloat16"], {"dp": 2, "fsdp": True, "dtype": "bfloat16"}),
    "04 llama ws2 grad-accum 2": ("04", 2, "llama", ["--grad-accum", "2"], {"dp": 2, "fsdp": True, "grad_accum": 2}),
    "05 checkpointing llama ws1": ("05", None, "llama", ["--activation-checkpointing"],
                                   {"fsdp": True, "split_root_group": True, "activation_checkpointing": True}),
    "06 llama ws2": ("06", 2, "llama", [], {"tp": 2}),
    "06 qwen2 ws4": ("06", 4, "qwen2", [], {"tp": 4}),
    "07 llama dp2 tp2": ("07", 4, "llama", ["--tp", "2"], {"dp": 2, "tp": 2, "fsdp": True}),
    "08 llama pp2": ("08", 2, "llama", ["--pp", "2"], {"pp": 2, "fsdp": True}),
    "09 llama cp2": ("09", 2, "llama", ["--cp", "2"], {"cp": 2, "fsdp": True}),
    # NOTE: 2 steps: a pipeline's first step also runs one micro-batch's forward to learn the shapes its stages send
    # (torch.distributed.pipelining's metadata inference), with tensor parallelism's collectives in it.
    "11 llama tp2 pp2": ("11", 4, "llama", ["--tp", "2", "--pp", "2", "--max-steps", "2"],
                         {"tp": 2, "pp": 2, "fsdp": True}),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("measured")


@pytest.fixture(scope="module")
def models(workdir):
    """The bundled tiny Llama, a 2-layer copy of it, and a tiny Qwen2 with the Llama's tokenizer."""
    qwen2 = workdir / "tiny-qwen2"
    qwen2.mkdir()
    for path in TINY_MODEL.glob("tokenizer*"):
        shutil.copy(path, qwen2)
    llama = json.loads((TINY_MODEL / "config.json").read_text())
    (qwen2 / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 130, "head_dim": 16,
        "intermediate_size": 344, "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 3,
        "vocab_size": llama["vocab_size"], "max_position_embeddings": 512, "tie_word_embeddings": False,
        "bos_token_id": llama.get("bos_token_id"), "eos_token_id": llama.get("eos_token_id"),
        "initializer_range": 0.02, "rms_norm_eps": 1e-6}))
    two_layers = workdir / "tiny-llama-2-layers"
    two_layers.mkdir()
    for path in TINY_MODEL.glob("tokenizer*"):
        shutil.copy(path, two_layers)
    (two_layers / "config.json").write_text(json.dumps({**llama, "num_hidden_layers": 2}))
    return {"llama": TINY_MODEL, "qwen2": qwen2, "llama-2-layers": two_layers}


@pytest.fixture(scope="module")
def measured_runs():
    return {}


def measure(measured_runs, env, workdir, models, name, case=None):
    """Run a case once per module under tools/measure_step.py: (its output, {rank: measurement})."""
    if name not in measured_runs:
        chapter, nproc, model, args, _ = case or CASES[name]
        out_dir = workdir / "measurements" / name.replace(" ", "-")
        launcher = [sys.executable] if nproc is None else torchrun(nproc)
        result, _ = train(chapter, env, workdir, *ONE_STEP, "-m", models[model], *args, nproc=nproc,
                          experiment=name.replace(" ", "-"), launcher=[*launcher, MEASURE, "--out", out_dir],
                          timeout=600)
        measured_runs[name] = (result, read_measurements(out_dir))
    return measured_runs[name]


def estimate(models, name, rank=0, case=None):
    _, _, model, _, layout = case or CASES[name]
    config = estimate_memory.load_config(models[model])
    return estimate_memory.estimate_step(config, estimate_memory.Layout(
        **{"batch_size": 2, "seq_length": 64, "dtype": "float32", "rank": rank, **layout}))


def sent_by_kind(collectives):
    totals = {}
    for key, counts in collectives.items():
        kind = key.split(" over ")[0]
        totals[kind] = totals.get(kind, 0.0) + counts["sent_bytes"]
    return totals


def estimated_by_kind(estimate):
    totals = {}
    for group in estimate["comm_by_group"].values():
        for kind, counts in group["collectives"].items():
            totals[kind] = totals.get(kind, 0.0) + counts["sent_bytes"]
    return totals


@pytest.mark.parametrize("name", CASES)
def test_the_estimate_is_the_memory_each_rank_holds(measured_runs, env, workdir, models, name):
    result, measurements = measure(measured_runs, env, workdir, models, name)
    logged = memory_held(result)
    lines = [f"{name}: rank | parameters | gradients | optimizer state (bytes, measured = estimated)"]
    for rank, measurement in sorted(measurements.items()):
        held = measurement["memory_held"]
        predicted = estimate(models, name, rank)
        lines.append(f"{rank} | {held['parameters']:,} | {held['gradients']:,} | {held['optimizer_state']:,}")
        assert (held["parameters"], held["gradients"], held["optimizer_state"]) == (
            predicted["params_bytes"], predicted["grads_bytes"], predicted["optimizer_bytes"]), (rank, predicted)
        if logged:
            # NOTE: the FSDP and TP chapters log the same three numbers themselves, in MB to two decimals.
            for kind, key in [("parameters", "parameters"), ("gradients", "gradients"),
                              ("optimizer state", "optimizer_state")]:
                assert abs(logged[rank][kind] - held[key] / 1e6) <= 0.005 + 1e-9, (rank, kind, logged[rank])
    print("\n".join(lines))


# NOTE: measured here: FSDP's bf16 step peaks at 29.37 MB above its start, estimated 23.14 MB (ratio 0.788); the
# estimator's bf16 activations and buffers on CPUs are not yet resolved (07's dry run is 37% off too).
BF16_PEAK_OPEN = pytest.mark.xfail(strict=True, raises=AssertionError, reason="bf16 FSDP peak estimated 21% low: open")


@pytest.mark.parametrize("name", [pytest.param(name, marks=BF16_PEAK_OPEN) if "bf16" in name else name
                                  for name in CASES])
def test_the_estimated_peak_of_a_step_is_within_15_percent_of_the_measured_one(measured_runs, env, workdir, models,
                                                                                name):
    _, measurements = measure(measured_runs, env, workdir, models, name)
    for rank, measurement in sorted(measurements.items()):
        measured = measurement["steps"][0]["peak_live_bytes_above_start"]
        predicted = estimate(models, name, rank)
        ratio = predicted["step_peak_above_start_bytes"] / measured
        print(f"{name} rank {rank}: peak of the step above its start: measured {measured / 1e6:.2f} MB, estimated "
              f"{predicted['step_peak_above_start_bytes'] / 1e6:.2f} MB ({predicted['peak_phase']}), ratio "
              f"{ratio:.3f}; activations {predicted['activations_bytes'] / 1e6:.2f} MB")
        assert abs(ratio - 1) <= 0.15


# NOTE: measured here: rank 0 of chapter 11's tp 2 x pp 2 all-reduces 139,344 bytes a step, estimated 135,248: 4 KiB
# of small all-reduces (every tensor and gradient otherwise to the byte) the estimator does not yet account for.
TP_PP_ALL_REDUCE_OPEN = pytest.mark.xfail(strict=True, raises=AssertionError,
                                          reason="4 KiB of tp x pp all-reduces not in the estimate: open")


@pytest.mark.parametrize("name", [pytest.param(name, marks=TP_PP_ALL_REDUCE_OPEN) if name.startswith("11") else name
                                  for name in CASES])
def test_the_estimated_communication_is_within_1_percent_of_the_measured_one(measured_runs, env, workdir, models,
                                                                             name):
    _, measurements = measure(measured_runs, env, workdir, models, name)
    for rank, measurement in sorted(measurements.items()):
        measured = sent_by_kind(measurement["steps"][-1]["collectives"])
        predicted = estimated_by_kind(estimate(models, name, rank))
        print(f"{name} rank {rank}: bytes sent per step, measured {({k: round(v) for k, v in measured.items()})}, "
              f"estimated {({k: round(v) for k, v in predicted.items()})}")
        # NOTE: a recv sends nothing, and the barriers and DDP's buffer broadcasts are left out of the estimate.
        assert {kind for kind, sent in measured.items() if sent} - {"barrier", "broadcast"} == (
            {kind for kind, sent in predicted.items() if sent} - {"broadcast"})
        for kind in measured.keys() | predicted.keys():
            assert measured.get(kind, 0) == pytest.approx(predicted.get(kind, 0), rel=0.01, abs=1024), kind


def num_parameters(models, model):
    return estimate_memory.estimate_step(estimate_memory.load_config(models[model]),
                                         estimate_memory.Layout())["num_parameters"]


@pytest.mark.parametrize("name", ["02 zero1 llama ws2", "02 zero1 qwen2 ws4"])
def test_ddp_all_reduces_2_psi_times_n_minus_1_over_n(measured_runs, env, workdir, models, name):
    _, world_size, model, _, _ = CASES[name]
    _, measurements = measure(measured_runs, env, workdir, models, name)
    psi = 4 * num_parameters(models, model)  # fp32 gradients, in bytes
    theory = 2 * psi * (world_size - 1) / world_size
    for rank, measurement in sorted(measurements.items()):
        sent = sent_by_kind(measurement["steps"][0]["collectives"])
        print(f"{name} rank {rank}: all-reduce sent {sent['all_reduce']:,.0f} bytes, 2 psi (N-1)/N = {theory:,.0f}; "
              f"ZeRO-1's broadcast of the updated weights {sent['broadcast']:,.0f}, psi (N-1)/N = "
              f"{psi * (world_size - 1) / world_size:,.0f}")
        assert sent["all_reduce"] == pytest.approx(theory, rel=0.01)
        assert sent["broadcast"] == pytest.approx(psi * (world_size - 1) / world_size, rel=0.01)


@pytest.mark.parametrize("name", ["04 llama ws2", "04 qwen2 ws4", "04 llama ws2 bf16", "04 llama ws2 grad-accum 2"])
def test_fsdp_all_gathers_and_reduce_scatters_3_psi_times_n_minus_1_over_n(measured_runs, env, workdir, models, name):
    # 3 psi per micro-batch: the weights all-gathered for forward and again for backward, the gradients
    # reduce-scattered; minus the groups chapter 04 does not free after forward (the last decoder layer and the root
    # group), which backward finds still gathered. The weights are gathered in the compute dtype (2 bytes a parameter
    # in bf16, 4 in fp32); the gradients are reduced in fp32 (MixedPrecisionPolicy's reduce_dtype).
    _, world_size, model, _, layout = CASES[name]
    _, measurements = measure(measured_runs, env, workdir, models, name)
    parameters = estimate_memory.model_parameters(estimate_memory.load_config(models[model]))
    last_layer = max(p.layer for p in parameters if p.layer is not None)
    numel = sum(estimate_memory.numel(p.shape) for p in parameters)
    kept_numel = sum(estimate_memory.numel(p.shape) for p in parameters if p.layer in (None, last_layer))
    width, micro_batches = (2 if layout.get("dtype") == "bfloat16" else 4), layout.get("grad_accum", 1)
    gathered = micro_batches * width * (2 * numel - kept_numel) * (world_size - 1) / world_size
    reduced = micro_batches * 4 * numel * (world_size - 1) / world_size
    for rank, measurement in sorted(measurements.items()):
        sent = sent_by_kind(measurement["steps"][0]["collectives"])
        print(f"{name} rank {rank}: all-gather {sent['all_gather']:,.0f} bytes vs {micro_batches} x {width} x "
              f"(2 psi - kept) (N-1)/N = {gathered:,.0f}; reduce-scatter {sent['reduce_scatter']:,.0f} vs "
              f"{micro_batches} x 4 psi (N-1)/N = {reduced:,.0f}")
        assert sent["all_gather"] == pytest.approx(gathered, rel=0.01)
        assert sent["reduce_scatter"] == pytest.approx(reduced, rel=0.01)


def test_tensor_parallel_sends_what_chapter_06_says_per_layer(measured_runs, env, workdir, models):
    # Chapter 06's README: per decoder layer and token, 8 collectives x (t - 1)/t x hidden x bytes per value. The
    # layers' share is what a 4-layer model sends more than a 2-layer one, halved.
    _, measurements = measure(measured_runs, env, workdir, models, "06 llama ws2")
    two_layer_case = ("06", 2, "llama-2-layers", [], {"tp": 2})
    _, two_layers = measure(measured_runs, env, workdir, models, "06 llama-2-layers ws2", two_layer_case)
    hidden, t = 256, 2
    formula = 8 * (t - 1) / t * hidden * 4 * TOKENS
    for rank in measurements:
        four = sent_by_kind(measurements[rank]["steps"][0]["collectives"])
        two = sent_by_kind(two_layers[rank]["steps"][0]["collectives"])
        per_layer = sum(four[kind] - two[kind] for kind in ("all_gather", "reduce_scatter")) / 2
        print(f"tp 2, rank {rank}: all-gathers and reduce-scatters per decoder layer {per_layer:,.0f} bytes; "
              f"8 x (t-1)/t x h x 4 bytes x {TOKENS} tokens = {formula:,.0f}")
        assert per_layer == pytest.approx(formula, rel=0.01)
