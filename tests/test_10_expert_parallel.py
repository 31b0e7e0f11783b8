"""Chapter 10: expert parallelism. CPU processes under torchrun (gloo) train the tiny Qwen3-MoE exactly as chapter 01
does on the same global batch (fp32, the load-balancing loss on), at ep 2, ep 4 and ep 2 x edp 2, losses and
gradient norms; the load-balancing loss is the global batch's, not a mean of per-rank ones; resume is exact at the
same --ep and continues at another; another MoE family (Mixtral) trains at ep 2 as in chapter 01; the all-to-all
bytes counted by tools/measure_step.py equal the theory; bad inputs get a one-line error; the README's CPU commands
run and it explains every definition the diff from chapter 04 adds or changes.

`pytest -s` prints the figures. Every training run takes 6 steps of 4 sequences of 64 tokens (global batch).
"""

import json
import shlex
import shutil
import types
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, MixtralConfig

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, MANY_RUNS, NO_CLIPPING, REPO, TINY_MODEL, check_family_matrix,
                     checkpoint_weights, error_lines, grad_norm_difference, load_script, max_difference, read_losses,
                     read_metrics, readme_experiment, run, script, torchrun, train)
from helpers import quick_cases
from test_drift import LINEAGE, top_level_definitions

README = REPO / CHAPTERS["10"] / "README.md"
MOE_MODEL = REPO / "data" / "tiny-qwen3-moe"
MEASURE = REPO / "tools" / "measure_step.py"
STEPS, HALF = 6, 3
GLOBAL_BATCH, SEQ_LENGTH = 4, 64
COMMON = ["--max-steps", str(STEPS), "--seq-length", str(SEQ_LENGTH), "--wandb-mode", "disabled"]

# name: (processes, the flags; --batch-size per rank is 4 / processes / grad-accum). Clipping at 1.0 binds at every
# step, except in the case with NO_CLIPPING (and its reference run).
LAYOUTS = {
    "ep2": (2, ["--ep", "2"]),
    "ep4": (4, ["--ep", "4"]),
    "ep2xedp2": (4, ["--ep", "2", *NO_CLIPPING]),
    # 2 micro-batches of 2 sequences: chapter 01 at --batch-size 2 --grad-accum 2 sees the same ones (rank r holds
    # sequences r and r + 2), and the load-balancing loss is each micro-batch's, in both.
    "ep2 grad-accum 2": (2, ["--ep", "2", "--grad-accum", "2"]),
}


def clipping(case):
    return NO_CLIPPING if NO_CLIPPING[0] in LAYOUTS[case][1] else []


def grad_accum(case):
    flags = LAYOUTS[case][1]
    return int(flags[flags.index("--grad-accum") + 1]) if "--grad-accum" in flags else 1


def reference_run(runs, env, case="ep2"):
    accum = ["--grad-accum", str(grad_accum(case))] if grad_accum(case) > 1 else []
    return runs.train("01", env, "-m", MOE_MODEL, *COMMON, "--batch-size", str(GLOBAL_BATCH // grad_accum(case)),
                      *accum, *clipping(case))


def layout_run(runs, env, case, *extra):
    nproc, flags = LAYOUTS[case]
    return runs.train("10", env, *COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // nproc // grad_accum(case)),
                      *extra, nproc=nproc)


@pytest.mark.parametrize("case", quick_cases(LAYOUTS, "ep2"))
def test_expert_parallelism_reproduces_chapter_01_losses(env, runs, case):
    _, reference = reference_run(runs, env, case)
    result, experiment = layout_run(runs, env, case)
    difference = max_difference(read_losses(reference), read_losses(experiment))
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping(case))
    records = read_metrics(experiment)
    print(f"\nparity {case} vs chapter 01 (batch {GLOBAL_BATCH} x {SEQ_LENGTH} tokens, {STEPS} steps, fp32, aux loss on): "
          f"largest loss difference {difference:.1e}, relative gradient norm difference {norm_difference:.1e}; "
          f"aux loss {records[0]['aux_loss']:.4f} -> {records[-1]['aux_loss']:.4f}, expert load (max/min over the "
          f"mean) step 1 {records[0]['expert_load_max']:.2f}/{records[0]['expert_load_min']:.2f}, step {STEPS} "
          f"{records[-1]['expert_load_max']:.2f}/{records[-1]['expert_load_min']:.2f}")
    assert difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    nproc, flags = LAYOUTS[case]
    ep = int(flags[flags.index("--ep") + 1])
    assert f"device mesh: {{'edp': {nproc // ep}, 'ep': {ep}}}" in result.stdout
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    assert all(record["expert_load_max"] >= 1 >= record["expert_load_min"] >= 0 for record in records)
    # FSDP shards over every rank, experts included: one file of shards per rank.
    assert sorted(path.name for path in (experiment / f"checkpoint-{STEPS:08d}").glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(nproc)]


def first_batch_router_logits(monkeypatch, env):
    """Chapter 01's model, weights and first global batch: its loss, aux loss and each layer's router logits."""
    import datasets

    # NOTE: the session's tokenized data, which the runs made already.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(Path(env["HF_HOME"]) / "datasets"))
    chapter = load_script("01")
    args = chapter.get_parser().parse_args(["-m", str(MOE_MODEL), "--seq-length", str(SEQ_LENGTH), "--batch-size",
                                            str(GLOBAL_BATCH), "--num-workers", "0"])
    tokenizer = AutoTokenizer.from_pretrained(MOE_MODEL)
    dataset = chapter.load_and_tokenize_dataset(args, tokenizer)
    state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    input_ids = next(chapter.get_micro_batches(dataset, args, state, torch.device("cpu")))["input_ids"]
    config = AutoConfig.from_pretrained(MOE_MODEL)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation=chapter.attention_implementation(config, SEQ_LENGTH))
    chapter.init_weights(model, 0)
    with torch.no_grad():
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False)
    return output, model.config


def test_the_load_balancing_loss_is_the_global_batchs_not_a_mean_of_per_rank_losses(env, runs, monkeypatch):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    _, experiment = layout_run(runs, env, "ep2")
    output, config = first_batch_router_logits(monkeypatch, env)
    aux = lambda logits: load_balancing_loss_func(logits, config.num_experts, config.num_experts_per_tok).item()
    global_aux = aux(output.router_logits)
    # Rank r of 2 holds sequences r and r + 2 of the global batch (DistributedSampler's deal).
    per_rank = [aux(tuple(layer.view(GLOBAL_BATCH, SEQ_LENGTH, -1)[rank::2].flatten(0, 1)
                          for layer in output.router_logits)) for rank in (0, 1)]
    per_rank_mean = sum(per_rank) / 2
    logged = read_metrics(experiment)[0]["aux_loss"]
    print(f"\nload-balancing loss of step 1 (4 x {SEQ_LENGTH} tokens, 4 layers, 8 experts, top-2): global batch "
          f"{global_aux:.6f}, mean of the 2 ranks' own {per_rank_mean:.6f} (rank 0 {per_rank[0]:.6f}, rank 1 "
          f"{per_rank[1]:.6f}), difference {per_rank_mean - global_aux:+.6f} ({(per_rank_mean / global_aux - 1):+.2%});"
          f" chapter 10 at ep 2 logged {logged:.6f}")
    assert abs(logged - global_aux) <= 1e-6 * global_aux
    # The expert load of step 1: each layer's top-k choices of the whole batch per expert, over their mean.
    counts = torch.stack([torch.bincount(layer.softmax(-1).topk(config.num_experts_per_tok).indices.flatten(),
                                         minlength=config.num_experts) for layer in output.router_logits]).double()
    load = counts / counts.mean(1, keepdim=True)
    first = read_metrics(experiment)[0]
    expected = (load.max().item(), load.min().item())
    assert (first["expert_load_max"], first["expert_load_min"]) == pytest.approx(expected, abs=1e-6)
    assert torch.allclose(torch.tensor(first["expert_load"], dtype=torch.float64), load, atol=1e-6)
    # The per-rank mean is another number: a test that could not tell them apart would prove nothing.
    assert abs(per_rank_mean - global_aux) >= 100 * 1e-6 * global_aux


def interrupted_run(runs, env):
    """ep 2, stopped after step 3 with its checkpoint; tools/measure_step.py counts what it sends."""
    nproc, flags = LAYOUTS["ep2"]
    return runs.train("10", env, *COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // nproc), "--exit-after-steps",
                      str(HALF), nproc=nproc,
                      launcher=[*torchrun(nproc), MEASURE, "--out", measured_dir(runs), "--log-calls"])


def measured_dir(runs):
    return runs.workdir / "measured-ep2"


def resumed(runs, env, experiment, nproc, *flags):
    """A copy of the interrupted experiment, resumed to the last step with flags."""
    _, source = interrupted_run(runs, env)
    assert [path.name for path in source.glob("checkpoint-*")] == [f"checkpoint-{HALF:08d}"]
    shutil.copytree(source, runs.workdir / "outputs" / experiment)
    result, resumed_dir = train("10", env, runs.workdir, *COMMON, *flags, nproc=nproc, experiment=experiment,
                                timeout=600)
    assert f"resumed from {resumed_dir / f'checkpoint-{HALF:08d}'}" in result.stdout
    return resumed_dir


def test_resume_is_exact(env, runs):
    _, straight = layout_run(runs, env, "ep2")
    resumed_dir = resumed(runs, env, "10-resumed-same", 2, "--ep", "2", "--batch-size", "2")
    difference = max_difference(read_losses(straight), read_losses(resumed_dir))
    print(f"\nresume ep 2: {STEPS} steps straight vs {HALF} + {STEPS - HALF}: largest loss difference {difference:.1e}")
    assert difference <= 1e-6
    assert grad_norm_difference(straight, resumed_dir, clipped=True) <= 1e-6


def test_resume_at_another_ep_reshards_the_experts(env, runs):
    # ep 2 (4 experts per rank, 2 sequences each) -> ep 4 (2 experts per rank, 1 sequence each): the same batches.
    _, straight = layout_run(runs, env, "ep2")
    resumed_dir = resumed(runs, env, "10-resumed-ep4", 4, "--ep", "4", "--batch-size", "1")
    difference = max_difference(read_losses(straight), read_losses(resumed_dir))
    print(f"\nresume ep 2 -> ep 4 after step {HALF}: largest loss difference {difference:.1e}")
    assert difference <= 1e-4
    assert grad_norm_difference(straight, resumed_dir, clipped=True) <= GRAD_NORM_TOLERANCE


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory):
    """Another family with its experts in 3D tensors: a tiny Mixtral (2 layers, 4 experts, top-2), the tokenizer of
    the tiny Llama."""
    folder = tmp_path_factory.mktemp("tiny-mixtral")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    MixtralConfig(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_mixtral_trains_at_ep_2_as_in_chapter_01(env, tmp_path, tiny_mixtral):
    flags = ["-m", tiny_mixtral, "--max-steps", "3", "--seq-length", str(SEQ_LENGTH), "--wandb-mode", "disabled"]
    _, reference = train("01", env, tmp_path, *flags, "--batch-size", "4", experiment="reference")
    result, experiment = train("10", env, tmp_path, *flags, "--ep", "2", "--batch-size", "2", nproc=2)
    difference = max_difference(read_losses(reference), read_losses(experiment))
    print(f"\ntiny Mixtral (4 experts, top-2) at ep 2 vs chapter 01: largest loss difference {difference:.1e}")
    assert "device mesh: {'edp': 1, 'ep': 2}" in result.stdout
    assert difference <= 1e-5
    assert grad_norm_difference(reference, experiment, clipped=True) <= GRAD_NORM_TOLERANCE


def test_a_pretrained_mixture_of_experts_stops_with_one_line(env, tmp_path, tiny_mixtral):
    """transformers 5 fuses a mixture's experts (experts.gate_up_proj); save_pretrained() and the hub's files hold
    each expert apart (block_sparse_moe.experts.0.w1): not loaded, every rank stops with the loader's one line (10's
    README trains these models from their config)."""
    pretrained = tmp_path / "mixtral-pretrained"
    shutil.copytree(tiny_mixtral, pretrained)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_mixtral)).save_pretrained(pretrained)
    result, _ = train("10", env, tmp_path, "-m", pretrained, "--ep", "2", "--max-steps", "1", nproc=2, check=False,
                      timeout=300)
    assert result.returncode == 1
    errors = error_lines(result.stderr)
    assert len(errors) == 2 and errors[0] == errors[1], result.stderr[-3000:]
    error = errors[0]
    assert error.startswith(f"error: cannot load the weights of {pretrained} (Missing key") and error.endswith(
        "; its *.safetensors must hold every weight its config.json describes"), result.stderr[-3000:]


def test_the_all_to_all_bytes_equal_the_theory(env, runs):
    # The first 3 steps at ep 2, 2 sequences of 64 tokens per rank, fp32, measured from outside the script.
    interrupted_run(runs, env)
    steps, ep, batch_per_rank = HALF, 2, GLOBAL_BATCH // 2
    config = AutoConfig.from_pretrained(MOE_MODEL)
    measurements = [json.loads((measured_dir(runs) / f"rank-{rank}.json").read_text()) for rank in range(ep)]
    # Per MoE layer and rank: tokens x top-k rows of hidden fp32 values, sent out and back (2 directions), forward and
    # backward (2 passes); (ep - 1) / ep of them leave the rank when the routing is even.
    tokens = batch_per_rank * SEQ_LENGTH
    buffers = tokens * config.num_experts_per_tok * config.hidden_size * 4 * 2 * 2 * config.num_hidden_layers
    theory = buffers * (ep - 1) / ep
    for step in range(steps):
        counted = [m["steps"][step]["collectives"][f"all_to_all over {ep} ranks [0,1]"] for m in measurements]
        buffer_bytes, sent_bytes = (sum(c[key] for c in counted) / ep for key in ("buffer_bytes", "sent_bytes"))
        print(f"\nall-to-all per rank, step {step + 1}: buffers {buffer_bytes / 1e6:.4f} MB (theory "
              f"{buffers / 1e6:.4f}, {buffer_bytes / buffers - 1:+.3%}), sent {sent_bytes / 1e6:.4f} MB (theory "
              f"{theory / 1e6:.4f} at even routing, {sent_bytes / theory - 1:+.2%}), {counted[0]['calls']} calls")
        # The token exchange, plus the counts' (num_experts fp32 per layer and forward): within 1% of the theory.
        assert abs(buffer_bytes / buffers - 1) <= 0.01
        assert counted[0]["calls"] == config.num_hidden_layers * 5
        # What leaves a rank follows the routing: (ep - 1) / ep of it when even, within the tiny model's imbalance.
        assert abs(sent_bytes / theory - 1) <= 0.15


def test_each_layer_all_gathers_the_next_before_it_waits_for_its_split_sizes(env, runs):
    # The forward's collectives and host syncs of step 2, in order, as tools/measure_step.py --log-calls saw them.
    # Each MoE layer reads its split sizes on the host (a sync); the next layer's all-gather must already be issued,
    # or the GPU would gather that layer only after the sync (implicit prefetching issues it when the CPU gets there).
    interrupted_run(runs, env)
    layers = AutoConfig.from_pretrained(MOE_MODEL).num_hidden_layers
    calls = json.loads((measured_dir(runs) / "rank-0.json").read_text())["steps"][1]["calls"]
    events = "".join("G" if key.startswith("all_gather") else "S" if key.startswith("host sync") else "."
                     for _, key, _ in calls)
    gathers_before_sync = [events[:at].count("G") for at, event in enumerate(events) if event == "S"]
    print(f"\nstep 2 on rank 0 (G all-gather, S host sync): {events}")
    assert len(gathers_before_sync) == layers
    # The root group's all-gather, then layers 0 to k + 1 before the sync of layer k.
    assert all(gathers_before_sync[k] >= k + 3 for k in range(layers - 1)), gathers_before_sync


def test_each_layer_lists_the_next_layer_and_its_experts_to_prefetch():
    # shard_model() as main() calls it, in this process, on a fake world of 4 at ep 2 and a model on the meta device:
    # each layer's FSDP group names the next layer's groups (its own and its experts') for explicit forward prefetch.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    chapter, config = load_script("10"), AutoConfig.from_pretrained(MOE_MODEL)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = chapter.get_device_mesh(torch.device("cpu"), 4, 2, config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        chapter.shard_model(model, mesh, torch.float32, cpu_offload=False)
        layers = model.model.layers
        for layer, next_layer in zip(layers, layers[1:]):
            groups = [next_layer, *([next_layer.mlp.experts] if hasattr(next_layer.mlp, "experts") else [])]
            assert layer._get_fsdp_state()._states_to_forward_prefetch == [g._get_fsdp_state() for g in groups]
        assert hasattr(layers[1].mlp, "experts") and not layers[-1]._get_fsdp_state()._states_to_forward_prefetch
    finally:
        dist.destroy_process_group()


# What each mistake says: the mesh's checks, called in this process on a world of the given size.
BAD_INPUTS = {
    "ep that does not divide the world": (4, 3, MOE_MODEL, "error: --ep 3 does not divide the world size 4; use a "
                                                            "divisor of 4"),
    "ep that does not divide the experts": (6, 3, MOE_MODEL, "error: --ep 3 does not divide the 8 experts of each "
                                                             "layer; use a divisor of 8"),
    "a dense model": (2, 2, TINY_MODEL, "error: --ep 2, but llama is a dense model (no experts); use --ep 1 or a "
                                        "mixture-of-experts model"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_a_bad_input_gets_a_one_line_error(case):
    world_size, ep, model, expected = BAD_INPUTS[case]
    with pytest.raises(SystemExit) as stopped:
        load_script("10").get_device_mesh(torch.device("cpu"), world_size, ep, AutoConfig.from_pretrained(model))
    assert str(stopped.value) == expected


def test_experts_fsdp_cannot_split_evenly_get_a_one_line_error():
    # The tiny model's experts have rows of 512 (gate_up_proj) and 256 (down_proj): 3 edp ranks cannot split them,
    # and FSDP2 shards dim 1 only evenly. The check runs before any collective: a mesh's sizes are all it reads.
    with torch.device("meta"):
        experts = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MOE_MODEL)).model.layers[0].mlp.experts
    mesh = {"edp": types.SimpleNamespace(size=lambda: 3)}
    with pytest.raises(SystemExit) as stopped:
        load_script("10").shard_experts(experts, mesh, {}, reshard_after_forward=True)
    assert str(stopped.value) == ("error: FSDP splits the experts' rows [256, 512] evenly over world size / --ep = 3 "
                                  "ranks, which do not divide them; use another --ep or world size")


def test_a_bad_input_stops_every_rank_with_one_line(env, tmp_path):
    result, _ = train("10", env, tmp_path, "--max-steps", "2", "--ep", "2", "-m", TINY_MODEL, nproc=2, check=False,
                      timeout=300)
    assert result.returncode == 1
    errors = sorted(set(error_lines(result.stderr)))
    assert errors == [BAD_INPUTS["a dense model"][3]], result.stderr[-3000:]
    assert f'File "{script("10")}"' not in result.stderr


def readme_text():
    return README.read_text()


def test_the_readme_cpu_commands_train(env, tmp_path):
    commands = [shlex.split(line.strip()) for line in readme_text().splitlines()
                if line.strip().startswith("torchrun --standalone --nproc-per-node ")
                and f"{CHAPTERS['10']}/train_llm.py" in line]
    cpu_commands = [command for command in commands if "-m" not in command]
    assert cpu_commands, "the README shows no CPU command"
    # NOTE: each its own experiment: a later one would resume an earlier one's finished run and train nothing
    assert len({readme_experiment(command, "10") for command in cpu_commands}) == len(cpu_commands)
    # Each as written, from a scratch folder of its own, shortened to 2 steps of 64
    # tokens.
    for number, command in enumerate(cpu_commands):
        at = command.index(f"{CHAPTERS['10']}/train_llm.py")
        (tmp_path / str(number)).mkdir()
        result = run([*command[:at], script("10"), *command[at + 1:], "--max-steps", "2", "--seq-length", "64"], env,
                     tmp_path / str(number), timeout=600)
        assert [record["step"] for record in read_metrics(tmp_path / str(number) / "outputs" / readme_experiment(command, "10"))] == [2]
        assert f"rank {int(command[3]) - 1} of {command[3]}" in result.stdout and "done: step 2 of 2" in result.stdout


def test_the_readme_explains_every_definition_the_diff_adds_or_changes():
    base, chapter = (top_level_definitions(script(name).read_text()) for name in ("04", "10"))
    added = [name for name in chapter if name not in base]
    changed = list(LINEAGE["04", "10"])
    text = readme_text()
    names = dict.fromkeys(name for name in added + changed
                          if name.isidentifier() and name not in ("__doc__", "imports"))
    missing = [name for name in names if f"`{name}" not in text]
    assert not missing, f"the README does not name {missing}"


def test_mfu_counts_the_active_parameters_only():
    # Per token, 2 of each layer's 8 experts compute: 6 FLOPs per active matmul weight (chapter 01's formula).
    config = AutoConfig.from_pretrained(MOE_MODEL)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert experts == 4 * 8 * 3 * 256 * 256
    others = sum(p.numel() for p in model.parameters()) - experts - model.get_input_embeddings().weight.numel()
    flops = load_script("10").get_flops_per_token(model, config, SEQ_LENGTH)
    assert flops == 6 * (others + experts * 2 / 8) + 12 * 4 * 8 * 32 * SEQ_LENGTH


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("10", runs, env, family_models)


def test_deepseek_v3s_selection_bias_moves_toward_balance_as_in_one_process_and_resumes(runs, env, family_models):
    """DeepSeek-V3 (sigmoid scores, group-limited top-k, a selection bias, a shared expert, MLA attention) moves each
    router's bias after every step, from the global batch's expert counts: at ep 2 and ep 2 x edp 2 as one process
    does, losses and gradient norms; a run stopped after step 3 resumes with the bias it saved, exactly."""
    family = "DeepSeek-V3 (MLA, shared expert)"
    args = ["--seq-length", "32", "--max-steps", str(STEPS), "--wandb-mode", "disabled", "--expert-bias-rate", "0.01",
            "-m", family_models[family], "-d", family_models["corpus"], *NO_CLIPPING]
    _, one_process = runs.train("10", env, *args, "--batch-size", "4")
    runs_file = runs.workdir / "deepseek-ep2.json"
    runs_file.write_text(json.dumps([["-e", "deepseek-ep2"], ["-e", "deepseek-resumed", "--exit-after-steps", "3"],
                                     ["-e", "deepseek-resumed"], ["-e", "deepseek-fixed-bias", "--expert-bias-rate", "0"]]))
    runs.train("10", env, *args, "--ep", "2", "--batch-size", "2", nproc=2,
               launcher=[*torchrun(2), MANY_RUNS, runs_file])
    _, ep2xedp2 = runs.train("10", env, *args, "--ep", "2", "--batch-size", "1", nproc=4)
    outputs = runs.workdir / "outputs"
    for name, experiment in [("ep 2", outputs / "deepseek-ep2"), ("ep 2 x edp 2", ep2xedp2),
                             ("ep 2, resumed after step 3", outputs / "deepseek-resumed")]:
        losses = max_difference(read_losses(one_process), read_losses(experiment))
        norms = grad_norm_difference(one_process, experiment, clipped=False)
        print(f"\nDeepSeek-V3, {name}, vs one process: losses {losses:.1e}, gradient norms {norms:.1e}")
        assert losses <= 1e-5 and norms <= GRAD_NORM_TOLERANCE
    resumed, straight = read_metrics(outputs / "deepseek-resumed"), read_metrics(outputs / "deepseek-ep2")
    assert [record["loss"] for record in resumed] == [record["loss"] for record in straight]
    # The positive control: with the bias left as built the routing, and so the losses, differ from step 2 on.
    fixed, moved = read_losses(outputs / "deepseek-fixed-bias"), [record["loss"] for record in straight]
    print(f"the moved bias against a fixed one, the losses' differences: {[round(a - b, 6) for a, b in zip(moved, fixed)]}")
    assert fixed[0] == moved[0] and all(a != b for a, b in zip(fixed[1:], moved[1:]))


def test_the_selection_bias_moves_by_the_rate_toward_the_mean_load_and_sums_to_zero():
    chapter = load_script("10")
    router = torch.nn.Module()
    router.register_buffer("e_score_correction_bias", torch.zeros(4))
    balancing = types.SimpleNamespace(routers=[router], biased=[True], bias_rate=0.5,
                                      step_counts=torch.tensor([[10.0, 2.0, 4.0, 4.0]]))
    chapter.LoadBalancing.update_biases(balancing)
    # The mean load is 5: expert 0 above it gets less, experts 1-3 below it more, the changes centered on 0.
    assert router.e_score_correction_bias.tolist() == [-0.75, 0.25, 0.25, 0.25] and balancing.step_counts == 0


def test_a_checkpointed_layer_s_recomputed_router_keeps_nothing_alive():
    """Activation checkpointing runs each router again in backward: its hook must record the forward's counts and
    probabilities only, or each recomputed probability keeps its layer's recomputed graph (its attention's saved
    tensors) alive until the next step's forward: 10 GB per MoE layer in a DeepSeek-V3 671B dry run."""
    chapter = load_script("10")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(MOE_MODEL))
    chapter.apply_activation_checkpointing(model)
    balancing = chapter.LoadBalancing(model, 0.0)
    input_ids = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert len(balancing.counts) == len(balancing.probabilities) == len(balancing.routers) > 0
    assert all(probabilities.grad_fn is not None for probabilities in balancing.probabilities), "the forward's"
