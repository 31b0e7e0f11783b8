"""tools/estimate_memory.py against what the chapters' scripts really hold and send, measured by tools/measure_step.py
(which runs a chapter unchanged, counting every collective and every tensor): parameters, gradients and optimizer
state to the byte, per rank, at world sizes 1, 2 and 4, on the bundled tiny Llama and on a tiny Qwen2 (biases, and a
hidden size of 130 that FSDP cannot split evenly over 4 ranks), FSDP in bf16 and with gradient accumulation too; the
bytes DDP, FSDP and tensor parallelism send per step against the textbook formulas and the estimate, within 1%,
pipeline (08) and ring-attention (09) sends included; the peak of a step's activations and transient buffers within
15% (bf16's is open: BF16_PEAK_OPEN). Chapter 10's expert parallelism (--ep) against FSDP2's and DTensor's own
sharding of a meta-device Qwen3-MoE under the fake process group: the state per rank to the byte, every FSDP group's
all-gather, the mesh coordinates; the all-to-all and the experts' FSDP bytes against their formulas; the errors;
the MoE MLP's activations against what transformers' own dropless MoE block saves for backward.

Every run trains one step of 2 sequences of 64 tokens, once per module. To check a new chapter, add its layouts to
CASES: the chapter, the processes, the model, its flags, and the estimator's flags for the same layout.
"""

import json
import shutil
import sys

import pytest

from helpers import PLAIN_TEXT, REPO, TINY_MODEL, memory_held, quick_cases, torchrun, train

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
    "05 checkpointing llama ws1": ("05", None, "llama", ["--activation-checkpointing", *PLAIN_TEXT],
                                   {"fsdp": True, "split_root_group": True, "activation_checkpointing": True}),
    "06 llama ws2": ("06", 2, "llama", [], {"tp": 2}),
    "06 qwen2 ws4": ("06", 4, "qwen2", [], {"tp": 4}),
    "07 llama dp2 tp2": ("07", 4, "llama", ["--tp", "2"], {"dp": 2, "tp": 2, "fsdp": True}),
    # NOTE: the replicas all-reduce once a step, not once per micro-batch.
    "07 llama hsdp 2 replicas grad-accum 2": ("07", 2, "llama", ["--dp-replicate", "2", "--grad-accum", "2"],
                                              {"dp": 2, "dp_replicate": 2, "fsdp": True, "grad_accum": 2}),
    "08 llama pp2": ("08", 2, "llama", ["--pp", "2"], {"pp": 2, "fsdp": True}),
    # NOTE: 2 steps, as for chapter 11 below: the first also gathers the layers for the pipeline's shape inference.
    "08 llama pp2 dp2 reduce per step": ("08", 4, "llama", ["--pp", "2", "--pp-grad-reduce", "step", "--max-steps",
                                                            "2"], {"pp": 2, "dp": 2, "fsdp": True,
                                                                   "pp_grad_reduce": "step"}),
    # NOTE: 4 micro-batches on 2 ranks x 2 stages each: rank 0 holds 5 of its half-size stages' in flight, 1F1B 2 whole.
    "08 llama pp2 interleaved grad-accum 2": ("08", 2, "llama", ["--pp", "2", "--pp-schedule", "interleaved-1f1b",
                                                                 "--grad-accum", "2"],
                                              {"pp": 2, "fsdp": True, "pp_schedule": "interleaved-1f1b",
                                               "batch_size": 1, "grad_accum": 4}),
    # NOTE: ZBV's V: rank 0 runs stages 0 and 3 (the embeddings, the head and the loss), each rank 2 whole in flight.
    "08 llama pp2 zbv grad-accum 2": ("08", 2, "llama", ["--pp", "2", "--pp-schedule", "zbv", "--pp-grad-reduce",
                                                         "step", "--grad-accum", "2", "--max-steps", "2"],
                                      {"pp": 2, "fsdp": True, "pp_schedule": "zbv", "pp_grad_reduce": "step",
                                       "batch_size": 1, "grad_accum": 4}),
    "09 llama cp2": ("09", 2, "llama", ["--cp", "2"], {"cp": 2, "fsdp": True}),
    "10 moe ep2 edp2": ("10", 4, "moe", ["--ep", "2"], {"dp": 4, "ep": 2, "fsdp": True}),
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
    return {"llama": TINY_MODEL, "qwen2": qwen2, "llama-2-layers": two_layers, "moe": REPO / "data" / "tiny-qwen3-moe"}


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


def sent_by_kind(collectives, field="sent_bytes"):
    totals = {}
    for key, counts in collectives.items():
        kind = key.split(" over ")[0]
        totals[kind] = totals.get(kind, 0.0) + counts[field]
    return totals


def estimated_by_kind(estimate):
    totals = {}
    for group in estimate["comm_by_group"].values():
        for kind, counts in group["collectives"].items():
            totals[kind] = totals.get(kind, 0.0) + counts["sent_bytes"]
    return totals


@pytest.mark.parametrize("name", quick_cases(CASES, "01 llama", "04 llama ws2", "06 llama ws2"))
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
# estimator's bf16 activations and buffers on CPUs are not yet resolved.
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


# NOTE: measured here: rank 0 of chapter 11's tp 2 x pp 2 all-reduces 139,344 bytes a step, estimated 135,248: FSDP
# all-reduces the 4 norms' Partial gradients (1 KiB each) over tp at each of the 2 pipeline micro-batches' reductions,
# the estimate once. Its layout here is one batch of 2 (--grad-accum 2 of 1 moves 08 pp2's peak estimate 25% high).
TP_PP_ALL_REDUCE_OPEN = pytest.mark.xfail(strict=True, raises=AssertionError,
                                          reason="4 KiB of tp x pp all-reduces not in the estimate: open")


@pytest.mark.parametrize("name", [pytest.param(name, marks=TP_PP_ALL_REDUCE_OPEN) if name.startswith("11") else name
                                  for name in CASES])
def test_the_estimated_communication_is_within_1_percent_of_the_measured_one(measured_runs, env, workdir, models,
                                                                             name):
    _, measurements = measure(measured_runs, env, workdir, models, name)
    # NOTE: how many routed tokens cross to another rank depends on the routing, which the estimate takes as even:
    # (N-1)/N of the buffers, as for every collective. A rank's all-to-all buffers average to the estimate's over ranks.
    all_to_all_buffers = [sent_by_kind(measurement["steps"][-1]["collectives"], "buffer_bytes").get("all_to_all", 0)
                          for measurement in measurements.values()]
    for rank, measurement in sorted(measurements.items()):
        measured = sent_by_kind(measurement["steps"][-1]["collectives"])
        predicted = estimate(models, name, rank)
        if "ep (all-to-all)" in predicted["comm_by_group"]:
            ep = predicted["comm_by_group"]["ep (all-to-all)"]["group_size"]
            print(f"{name} rank {rank}: all-to-all sends {measured['all_to_all']:,.0f} bytes with this routing")
            measured["all_to_all"] = sum(all_to_all_buffers) / len(all_to_all_buffers) * (ep - 1) / ep
        predicted = estimated_by_kind(predicted)
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


# ---------------------------------------------------------------------------------------------------------------------
# Chapter 10's expert parallelism (--ep), against FSDP2 and DTensor's own sharding of a meta-device Qwen3-MoE under
# PyTorch's fake process group (no chapter run: the tiny MoE model and the chapter come with chapter 10). The rule
# is: world = edp x ep ranks on a mesh ("edp", "ep"), ep fastest; the experts' 3D tensors Shard(0) over ep,
# then fully_shard over edp with Shard(1), a group of their own inside their layer's; the rest FSDP-sharded over all
# ranks as in chapter 04 (a group per decoder layer and the root).

TINY_MOE = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 256, "intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "norm_topk_prob": True, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """data/tiny-qwen3-moe's config, one with a hidden size of 130, which chapter 04's FSDP splits unevenly, and a
    tiny Mixtral (transformers stores its experts the same way)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    folders = {}
    for name, changes in [("tiny-qwen3-moe", {}), ("tiny-qwen3-moe-130", {"hidden_size": 130})]:
        folders[name] = tmp_path_factory.mktemp(name)
        Qwen3MoeConfig(**{**TINY_MOE, **changes}).save_pretrained(folders[name])
    folders["tiny-mixtral"] = tmp_path_factory.mktemp("tiny-mixtral")
    MixtralConfig(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                  tie_word_embeddings=False).save_pretrained(folders["tiny-mixtral"])
    return folders


def shard_like_chapter_10(config, rank, dp, ep):
    """This rank's model, sharded by the rule above on the meta device: {name: local shape}, every FSDP group's
    {name: (elements its all-gather carries, ranks it spans)} by the estimator's group names, and the rank's
    (edp, ep) coordinates on the mesh."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import AutoModelForCausalLM

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp)
    try:
        mesh = init_device_mesh("cpu", (dp // ep, ep), mesh_dim_names=("edp", "ep"))
        everyone = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        names = {model: "root"}
        for index, layer in enumerate(model.model.layers):
            experts = layer.mlp.experts
            for name, param in list(experts.named_parameters()):
                local = torch.empty(param.shape[0] // ep, *param.shape[1:], device="meta")
                setattr(experts, name, torch.nn.Parameter(DTensor.from_local(
                    local, mesh["ep"], [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())))
            fully_shard(experts, mesh=mesh["edp"], shard_placement_fn=lambda _: Shard(1))
            fully_shard(layer, mesh=everyone)
            names[experts], names[layer] = f"layer {index} experts", f"layer {index}"
        fully_shard(model, mesh=everyone)
        shapes = {name: tuple(param.to_local().shape) for name, param in model.named_parameters()}
        groups = {}
        for module, name in names.items():
            params = module._get_fsdp_state()._fsdp_param_group.fsdp_params
            groups[name] = (sum(p.padded_sharded_param_size.numel() * p.mesh_info.shard_mesh_size for p in params),
                            {p.mesh_info.shard_mesh_size for p in params})
        return shapes, groups, (mesh["edp"].get_local_rank(), mesh["ep"].get_local_rank())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("model, dp, ep", [("tiny-qwen3-moe", 2, 2), ("tiny-qwen3-moe", 4, 2),
                                           ("tiny-qwen3-moe", 8, 4), ("tiny-qwen3-moe", 4, 1),
                                           ("tiny-qwen3-moe-130", 4, 2), ("tiny-mixtral", 4, 2)])
def test_expert_parallel_state_per_rank_is_what_fully_shard_holds(moe_models, model, dp, ep):
    config = estimate_memory.load_config(moe_models[model])
    parameters = estimate_memory.model_parameters(config)
    dims = estimate_memory.model_dimensions(config, parameters)
    lines = [f"{model} dp {dp} ep {ep}: rank | parameters | of which experts (bytes, held = estimated)"]
    for rank in range(dp):
        shapes, groups, mesh_coordinates = shard_like_chapter_10(config, rank, dp, ep)
        held = 4 * sum(estimate_memory.numel(shape) for shape in shapes.values())
        held_experts = 4 * sum(estimate_memory.numel(shape) for name, shape in shapes.items() if ".experts." in name)
        layout = estimate_memory.Layout(dp=dp, fsdp=True, ep=ep, rank=rank)
        predicted = estimate_memory.estimate_step(config, layout)
        # NOTE: FSDP reduce-scatters each gradient into its parameter's shard; AdamW keeps two fp32 moments of it.
        assert (predicted["params_bytes"], predicted["grads_bytes"], predicted["optimizer_bytes"]) == (
            held, held, 2 * held), rank
        assert predicted["expert_params_bytes"] == held_experts, rank
        coords = estimate_memory.rank_coordinates(layout)
        assert (coords.edp, coords.ep) == mesh_coordinates, rank
        estimated_groups = estimate_memory.fsdp_groups(parameters, dims, layout, coords)
        assert {name: (g.padded_numel, {g.shards}) for name, g in estimated_groups.items()} == groups, rank
        lines.append(f"{rank} | {held:,} | {held_experts:,}")
    print("\n".join(lines))


def test_the_experts_split_only_where_fsdp2_can_split_them(moe_models):
    # dp 6, ep 2: 3 expert-data-parallel ranks, which do not divide dim 1 of the experts (512 and 256 rows).
    import torch.distributed as dist

    config = estimate_memory.load_config(moe_models["tiny-qwen3-moe"])
    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        shard_like_chapter_10(config, 0, 6, 2)
    assert not dist.is_initialized()
    with pytest.raises(SystemExit, match=r"^error: 3 expert-data-parallel ranks .* do not divide dim 1"):
        estimate_memory.estimate_step(config, estimate_memory.Layout(dp=6, fsdp=True, ep=2))


@pytest.mark.parametrize("dp, ep, grad_accum, dtype", [(4, 4, 1, "float32"), (8, 2, 2, "bfloat16"),
                                                       (4, 1, 1, "bfloat16"), (2, 2, 3, "bfloat16")])
def test_expert_parallel_sends_the_routed_tokens_and_gathers_only_the_local_experts(moe_models, dp, ep, grad_accum,
                                                                                  dtype):
    config = estimate_memory.load_config(moe_models["tiny-qwen3-moe"])
    batch, seq = 3, 64
    comm = estimate_memory.estimate_step(config, estimate_memory.Layout(
        dp=dp, fsdp=True, ep=ep, batch_size=batch, seq_length=seq, grad_accum=grad_accum, dtype=dtype))["comm_by_group"]
    width = 2 if dtype == "bfloat16" else 4
    hidden, top_k, experts, layers, moe_width = 256, 2, 8, 4, 256
    # Tokens x top-k x hidden x bytes x 2 directions x 2 passes x (ep - 1) / ep, per MoE layer and micro-batch.
    all_to_all = batch * seq * grad_accum * top_k * hidden * width * 2 * 2 * (ep - 1) / ep * layers
    assert comm.get("ep (all-to-all)", {"sent_bytes": 0})["sent_bytes"] == pytest.approx(all_to_all, rel=1e-12)
    # The experts' FSDP over dp / ep ranks: each micro-batch gathers this rank's experts for forward and again for
    # backward (the last layer's once: kept, as in chapter 04) and reduce-scatters their fp32 gradients.
    edp, local = dp // ep, experts // ep * 3 * hidden * moe_width
    gathered = grad_accum * width * local * (2 * layers - 1) * (edp - 1) / edp
    reduced = grad_accum * 4 * local * layers * (edp - 1) / edp
    experts_fsdp = comm.get("edp (experts' FSDP)", {"collectives": {}})["collectives"]
    assert experts_fsdp.get("all_gather", {"sent_bytes": 0})["sent_bytes"] == pytest.approx(gathered, rel=1e-12)
    assert experts_fsdp.get("reduce_scatter", {"sent_bytes": 0})["sent_bytes"] == pytest.approx(reduced, rel=1e-12)
    assert comm["dp (FSDP)"]["group_size"] == dp


def test_active_parameters_are_the_non_experts_and_top_k_of_the_experts(moe_models):
    import torch
    from transformers import AutoModelForCausalLM

    config = estimate_memory.load_config(moe_models["tiny-qwen3-moe"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    in_experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    estimate = estimate_memory.estimate_step(config, estimate_memory.Layout())
    assert (estimate["num_parameters"], estimate["num_expert_parameters"]) == (total, in_experts)
    assert estimate["num_active_parameters"] == total - in_experts + in_experts * 2 // 8
    # Qwen publishes 30.5B parameters, 3.3B activated, and 235B, 22B activated (the models' cards).
    for name, published_total, published_active in [("qwen3-30b-a3b", 30.5e9, 3.3e9),
                                                    ("qwen3-235b-a22b", 235e9, 22e9)]:
        big = estimate_memory.estimate_step(estimate_memory.load_config(REPO / "data" / "configs" / name),
                                            estimate_memory.Layout(dp=8, fsdp=True, ep=8, dtype="bfloat16"))
        print(f"{name}: {big['num_parameters']:,} parameters, {big['num_active_parameters']:,.0f} active")
        assert big["num_parameters"] == pytest.approx(published_total, rel=0.005)
        assert big["num_active_parameters"] == pytest.approx(published_active, rel=0.02)


@pytest.mark.parametrize("flags, message", [
    (["--ep", "2", "--dp", "2"], "add --fsdp"),
    (["--ep", "3", "--dp", "4", "--fsdp"], "--ep 3 does not divide --dp 4"),
    (["--ep", "2", "--dp", "4", "--fsdp", "--tp", "2"], "--ep combines with --dp and --fsdp only"),
    (["--ep", "0", "--dp", "4", "--fsdp"], "--ep must be at least 1"),
    (["--ep", "2", "--dp", "2", "--fsdp", "-m", str(TINY_MODEL)], "--ep 2 needs a mixture of experts"),
    (["--ep", "16", "--dp", "16", "--fsdp"], "--ep 16 does not divide the model's 8 experts"),
])
def test_a_bad_expert_parallel_layout_is_a_one_line_error(moe_models, monkeypatch, flags, message):
    model = [] if "-m" in flags else ["-m", str(moe_models["tiny-qwen3-moe"])]
    monkeypatch.setattr(sys, "argv", ["estimate_memory.py", *model, *flags])
    with pytest.raises(SystemExit) as error:
        estimate_memory.main()
    assert str(error.value).startswith("error: ") and message in str(error.value), error.value
    assert "\n" not in str(error.value)


def test_a_dense_model_with_ep_1_is_chapter_04(models):
    config = estimate_memory.load_config(models["llama"])
    chapter_04 = estimate_memory.estimate_step(config, estimate_memory.Layout(dp=4, fsdp=True))
    ep_1 = estimate_memory.estimate_step(config, estimate_memory.Layout(dp=4, fsdp=True, ep=1))
    assert {**ep_1, "layout": None} == {**chapter_04, "layout": None}


@pytest.mark.parametrize("dtype, hidden, width, experts, top_k", [
    ("float32", 256, 256, 8, 2), ("bfloat16", 256, 256, 8, 2), ("float32", 128, 96, 16, 4)])
def test_the_moe_activations_are_what_a_dropless_top_k_layer_saves(dtype, hidden, width, experts, top_k):
    # transformers' Qwen3MoeSparseMoeBlock (a loop over the experts hit, dropless): every tensor autograd saves
    # that is neither a parameter nor the block's input, counted once per storage, against the estimate per token.
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k,
                                                  moe_intermediate_size=width)).to(getattr(torch, dtype))
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.02)
    tokens = torch.randn(2, 512, hidden, dtype=getattr(torch, dtype), requires_grad=True)
    parameters = {param.untyped_storage().data_ptr() for param in block.parameters()}
    saved = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and storage.data_ptr() != tokens.untyped_storage().data_ptr():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        block(tokens)
    dims = estimate_memory.Dimensions(hidden=hidden, heads=1, kv_heads=1, head_dim=1, intermediate=1, vocab=1,
                                      layers=1, tied=False, experts=experts, top_k=top_k, moe_intermediate=width)
    widths = estimate_memory.byte_widths(estimate_memory.Layout(dtype=dtype, fsdp=True))
    estimated = estimate_memory.moe_mlp_bytes_per_token(dims, widths) * 2 * 512
    print(f"{dtype} h {hidden} moe width {width} top {top_k} of {experts}: saved {sum(saved.values()):,} bytes, "
          f"estimated {estimated:,.0f} (the router's logits, which the auxiliary loss keeps, included)")
    assert sum(saved.values()) == pytest.approx(estimated, rel=0.02)


@pytest.mark.quick
def test_the_pipeline_bubble_is_each_schedules_formula():
    """(p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (2m + p - 1) for interleaved 1F1B at 2 stages per rank,
    (p - 1) / (6m + p - 1) for interleaved zero bubble and ZBV: chapter 08's 70B layout, 8 stages and 16
    micro-batches, idles 30.4%, 17.9% or 6.8% of a step; no pipeline, no bubble."""
    assert estimate_memory.pipeline_bubble(8, 16) == pytest.approx(
        {"gpipe": 7 / 23, "1f1b": 7 / 23, "interleaved-1f1b": 7 / 39, "interleaved-zb": 7 / 103, "zbv": 7 / 103})
    assert estimate_memory.pipeline_bubble(1, 16) == {}


def unit_time_idle_shares(schedule, stages, micro_batches):
    """Each rank's idle share of torch's own schedule run with every forward, input-gradient and weight-gradient
    pass of a stage taking one unit (a whole backward two), each waiting for the passes it needs."""
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    schedule.pp_group_size, schedule._n_microbatches, schedule.num_stages = stages, micro_batches, 2 * stages
    schedule.n_local_stages = 2
    orders = {rank: [action for action in schedule._calculate_single_rank_operations(rank) if action is not None]
              for rank in range(stages)}
    kinds = {Kind.FORWARD: ("F", 1), Kind.BACKWARD_INPUT: ("I", 1), Kind.FULL_BACKWARD: ("I", 2),
             Kind.BACKWARD_WEIGHT: ("W", 1)}
    finished, clock, busy, position = {}, [0] * stages, [0] * stages, [0] * stages

    def needs(action):
        kind, index, micro_batch = kinds[action.computation_type][0], action.stage_index, action.microbatch_index
        if kind == "F":
            return [("F", index - 1, micro_batch)] if index else []
        if kind == "I":
            return [("F", index, micro_batch)] + ([("I", index + 1, micro_batch)] if index < 2 * stages - 1 else [])
        return [("I", index, micro_batch)]

    while any(position[rank] < len(orders[rank]) for rank in range(stages)):
        moved = False
        for rank in range(stages):
            while position[rank] < len(orders[rank]):
                action = orders[rank][position[rank]]
                parts = action.sub_actions or (action,)
                waits = [need for part in parts for need in needs(part)]
                if any(need not in finished for need in waits):
                    break
                start = max([clock[rank], *(finished[need] for need in waits)])
                for part in parts:
                    kind, cost = kinds[part.computation_type]
                    start += cost
                    busy[rank] += cost
                    finished[kind, part.stage_index, part.microbatch_index] = start
                clock[rank], position[rank], moved = start, position[rank] + 1, True
        assert moved, "the schedule deadlocked"
    return [1 - work / max(clock) for work in busy]


@pytest.mark.quick
def test_the_zero_bubble_schedules_idle_as_their_formulas_say_and_dualpipev_more():
    """pipeline_bubble()'s interleaved zero bubble and ZBV against torch's own schedules run at unit times, from one
    micro-batch up (where the fill and drain set the span); torch's DualPipeV, its forward and backward pairs run in
    turn (as without a custom overlap), idles (p - 1) / (3m + p - 1): 1.8 times ZBV's share or more at the m >= 2p
    it needs, why chapter 08 does not offer it (its README)."""
    from torch.distributed.pipelining.schedules import (ScheduleDualPipeV, ScheduleInterleavedZeroBubble,
                                                        ScheduleZBVZeroBubble)

    for stages, micro_batches in [(2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2), (4, 4), (4, 8), (4, 16), (8, 4),
                                  (8, 8), (8, 16), (8, 32)]:
        formula = estimate_memory.pipeline_bubble(stages, micro_batches)
        zbv = unit_time_idle_shares(object.__new__(ScheduleZBVZeroBubble), stages, micro_batches)
        assert max(zbv) == pytest.approx(formula["zbv"], abs=1e-12), (stages, micro_batches, zbv)
        interleaved = object.__new__(ScheduleInterleavedZeroBubble)
        interleaved.number_of_rounds = max(1, micro_batches // stages)
        interleaved.microbatches_per_round = micro_batches // interleaved.number_of_rounds
        shares = unit_time_idle_shares(interleaved, stages, micro_batches)
        assert max(shares) == pytest.approx(formula["interleaved-zb"], abs=1e-12), (stages, micro_batches, shares)
        if micro_batches >= 2 * stages:
            dualpipev = unit_time_idle_shares(object.__new__(ScheduleDualPipeV), stages, micro_batches)
            assert max(dualpipev) == pytest.approx((stages - 1) / (3 * micro_batches + stages - 1), abs=1e-12)
            assert max(dualpipev) >= 1.8 * max(zbv), (stages, micro_batches, zbv, dualpipev)


@pytest.mark.quick
@pytest.mark.parametrize("flags", [["--pp-grad-reduce", "microbatch"],
                                   ["--pp-grad-reduce", "step", "--activation-checkpointing"]])
def test_a_zbv_layout_the_chapters_refuse_is_a_one_line_error(monkeypatch, flags):
    monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "-m", str(TINY_MODEL), "--pp", "2", "--pp-schedule", "zbv",
                                      *flags])
    with pytest.raises(SystemExit) as error:
        estimate_memory.main()
    assert str(error.value) == "error: --pp-schedule zbv splits each backward in two; use --pp-grad-reduce step, " \
        "without --activation-checkpointing (chapter 08)"


@pytest.mark.quick
def test_the_in_flight_count_of_interleaved_1f1b_is_torchs():
    """IN_FLIGHT's interleaved 1F1B against torch's own schedule: on every rank of p ranks of v stages and m
    micro-batches, the most forward chunks whose backward has not run, in units of a rank's layers."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for stages, per_rank in [(2, 2), (4, 2), (8, 2), (16, 2), (4, 3)]:
        for micro_batches in sorted({max(1, stages // 2), stages, 2 * stages, 3 * stages, 4 * stages}):
            for rank in range(stages):
                schedule = object.__new__(ScheduleInterleaved1F1B)
                schedule.pp_group_size, schedule.n_local_stages = stages, per_rank
                schedule._n_microbatches = micro_batches
                schedule.microbatches_per_round = micro_batches // max(1, micro_batches // stages)
                held = most = 0
                for action in filter(None, schedule._calculate_single_rank_operations(rank)):
                    held += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}[action.computation_type]
                    most = max(most, held)
                in_flight = estimate_memory.IN_FLIGHT["interleaved-1f1b"](stages, rank, micro_batches, per_rank)
                assert in_flight == most / per_rank, (stages, per_rank, micro_batches, rank)


@pytest.mark.quick
def test_the_in_flight_count_of_zbv_is_torchs():
    """IN_FLIGHT's ZBV against torch's own schedule, as above: the most forwards whose input-gradient pass has not
    run, in units of a rank's two stages. torch's DualPipeV holds one stage's micro-batch more at m >= 2p."""
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble, _ComputationType

    change = {_ComputationType.FORWARD: 1, _ComputationType.BACKWARD_INPUT: -1, _ComputationType.FULL_BACKWARD: -1}

    def most_held(schedule_class, stages, rank, micro_batches):
        schedule = object.__new__(schedule_class)
        schedule.pp_group_size, schedule._n_microbatches = stages, micro_batches
        schedule.num_stages, schedule.n_local_stages = 2 * stages, 2
        held = most = 0
        for action in filter(None, schedule._calculate_single_rank_operations(rank)):
            for part in action.sub_actions or (action,):
                held += change.get(part.computation_type, 0)
                most = max(most, held)
        return most

    for stages in (2, 4, 8):
        for micro_batches in sorted({1, stages, 2 * stages - 1, 2 * stages, 4 * stages}):
            for rank in range(stages):
                zbv = most_held(ScheduleZBVZeroBubble, stages, rank, micro_batches)
                assert estimate_memory.IN_FLIGHT["zbv"](stages, rank, micro_batches, 2) == zbv / 2
                if micro_batches >= 2 * stages:
                    assert most_held(ScheduleDualPipeV, stages, rank, micro_batches) == zbv + 1


@pytest.mark.quick
@pytest.mark.parametrize("flags, message", [
    (["--pp", "8"], "--pp 8 makes 8 stages, more than the model's 4 decoder layers; use a smaller --pp"),
    (["--pp", "4", "--pp-schedule", "interleaved-1f1b"],
     "--pp 4 makes 8 stages, more than the model's 4 decoder layers; use a smaller --pp or --pp-stages-per-rank"),
])
def test_more_stages_than_layers_is_a_one_line_error(monkeypatch, flags, message):
    monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "-m", str(TINY_MODEL), *flags])
    with pytest.raises(SystemExit) as error:
        estimate_memory.main()
    assert str(error.value) == f"error: {message}"
