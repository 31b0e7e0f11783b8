"""Chapter 09: context parallelism. The attention across the split (ring and all-to-all, load balancing on and off)
computes what full causal attention computes, module by module; CPU processes under torchrun (gloo) train exactly as
chapter 01 does on the same global batch, at cp 2 and at dp 2 x cp 2, on sequences of 256 tokens; resume is exact,
at the same --cp and at another; bad inputs get a one-line error; activation memory per rank falls as 1/cp and load
balancing evens out the ranks' attention work; ring attention multiplies with SDPA's fused kernel alone and never
holds a block of scores; the README's CPU commands run and it explains every definition the diff from chapter 04
adds or changes.

`pytest -s` prints the figures. Every training run takes 6 steps of 4 sequences of 256 tokens (global batch).
"""

import json
import re
import shlex
import shutil
import sys
from collections import defaultdict

import pytest
import torch

from transformers import AutoConfig

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, NO_CLIPPING, REPO, TINY_MODEL, error_lines, grad_norm_difference,
                     load_script, max_difference, read_losses, read_metrics, readme_experiment, run, script, torchrun,
                     train, check_family_matrix)
from helpers import quick_cases
from test_drift import LINEAGE, top_level_definitions

sys.path.insert(0, str(REPO / "tools"))
from measure_step import StepMeter, make_dispatch_mode  # noqa: E402

README = REPO / CHAPTERS["09"] / "README.md"
ATTENTION_CHECK = REPO / CHAPTERS["09"] / "cp_attention_check.py"
MEASURE = REPO / CHAPTERS["09"] / "measure_context_parallel.py"
STEPS, HALF = 6, 3
GLOBAL_BATCH, SEQ_LENGTH = 4, 256
COMMON = ["--max-steps", str(STEPS), "--seq-length", str(SEQ_LENGTH), "--wandb-mode", "disabled"]

# name: (processes, the flags; --batch-size is per data-parallel rank: 4 / (processes / cp)). Clipping at 1.0
# binds at every step, except in the case with NO_CLIPPING (and its reference run).
LAYOUTS = {
    "cp2-ring": (2, ["--cp", "2"]),
    "dp2xcp2-ring": (4, ["--cp", "2"]),
    "dp2xcp2-all-to-all-unbalanced": (4, ["--cp", "2", "--cp-attention", "all-to-all", "--cp-load-balance", "off",
                                          *NO_CLIPPING]),
}


def clipping(case):
    return NO_CLIPPING if NO_CLIPPING[0] in LAYOUTS[case][1] else []


def reference_run(runs, env, case="cp2-ring"):
    return runs.train("01", env, *COMMON, "--batch-size", str(GLOBAL_BATCH), *clipping(case))


def layout_run(runs, env, case, *extra):
    nproc, flags = LAYOUTS[case]
    dp_size = nproc // int(flags[flags.index("--cp") + 1])
    return runs.train("09", env, *COMMON, *flags, "--batch-size", str(GLOBAL_BATCH // dp_size), *extra, nproc=nproc)


def test_the_split_attention_equals_full_causal_attention_module_by_module(env, tmp_path):
    result = run([*torchrun(4), ATTENTION_CHECK], env, tmp_path, timeout=600)
    lines = re.findall(r"^(?:==|   cp).*$", result.stdout, re.MULTILINE)
    print("\nattention check, 4 ranks:\n" + "\n".join(lines))
    # Every layout 4 ranks make, both forms, load balancing on and off: attention alone and the whole model.
    for cp_size in (2, 4):
        assert f"== cp {cp_size} " in result.stdout and "head-tail layout is ours: True" in result.stdout
        for form in ("ring", "all-to-all"):
            for balance in ("on", "off"):
                case = f"cp {cp_size}, {form}, load balancing {balance}"
                assert re.search(rf"^   {re.escape(case)} +attention alone: output ", result.stdout, re.MULTILINE)
                assert re.search(rf"^   {re.escape(case)} +whole model: module output ", result.stdout, re.MULTILINE)
    assert "ok: every output and gradient within 1e-06 of full causal attention" in result.stdout


def test_the_attention_check_catches_a_ring_that_lets_queries_see_later_tokens(env, tmp_path):
    # The ring with visible_block() broken: every other rank's keys all visible. The check must fail, at the ring.
    result = run([*torchrun(2), ATTENTION_CHECK], {**env, "CP_CHECK_BREAK": "ring-sees-the-future"}, tmp_path,
                 timeout=600, check=False)
    errors = sorted(set(error_lines(result.stderr)))
    print(f"\nattention check with a broken ring: {errors}")
    assert result.returncode != 0 and len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("error: cp 2, ring, load balancing on: attention output differs by")


@pytest.mark.parametrize("case", quick_cases(LAYOUTS, "cp2-ring"))
def test_context_parallel_reproduces_chapter_01_losses(env, runs, case):
    _, reference = reference_run(runs, env, case)
    result, experiment = layout_run(runs, env, case)
    difference = max_difference(read_losses(reference), read_losses(experiment))
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping(case))
    print(f"\nparity {case} vs chapter 01 (batch {GLOBAL_BATCH} x {SEQ_LENGTH} tokens, {STEPS} steps, fp32): "
          f"largest loss difference {difference:.1e}, relative gradient norm difference {norm_difference:.1e}")
    assert difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE
    nproc, flags = LAYOUTS[case]
    cp_size = int(flags[flags.index("--cp") + 1])
    assert f"device mesh: {{'dp': {nproc // cp_size}, 'cp': {cp_size}}}" in result.stdout
    assert [record["step"] for record in read_metrics(experiment)] == list(range(1, STEPS + 1))
    # FSDP shards over every rank, dp and cp: one file of shards per rank.
    assert sorted(path.name for path in (experiment / f"checkpoint-{STEPS:08d}").glob("*.distcp")) == [
        f"__{rank}_0.distcp" for rank in range(nproc)]


def interrupted_run(runs, env):
    """dp 2 x cp 2, stopped after step 3 with its checkpoint."""
    return layout_run(runs, env, "dp2xcp2-ring", "--exit-after-steps", str(HALF))


def resumed(runs, env, experiment, nproc, *flags):
    """A copy of the interrupted experiment, resumed to the last step with flags."""
    _, source = interrupted_run(runs, env)
    assert [path.name for path in source.glob("checkpoint-*")] == [f"checkpoint-{HALF:08d}"]
    shutil.copytree(source, runs.workdir / "outputs" / experiment)
    result, resumed_dir = train("09", env, runs.workdir, *COMMON, *flags, nproc=nproc, experiment=experiment,
                                timeout=600)
    assert f"resumed from {resumed_dir / f'checkpoint-{HALF:08d}'}" in result.stdout
    return resumed_dir


def test_resume_is_exact(env, runs):
    _, straight = layout_run(runs, env, "dp2xcp2-ring")
    resumed_dir = resumed(runs, env, "resumed-same", 4, "--cp", "2", "--batch-size", "2")
    difference = max_difference(read_losses(straight), read_losses(resumed_dir))
    print(f"\nresume dp 2 x cp 2: {STEPS} steps straight vs {HALF} + {STEPS - HALF}: largest loss difference "
          f"{difference:.1e}")
    assert difference <= 1e-6
    assert grad_norm_difference(straight, resumed_dir, clipped=True) <= 1e-6


def test_resume_at_another_cp_continues_exactly(env, runs):
    # dp 2 x cp 2 with 2 sequences per dp rank -> dp 1 x cp 4 with 4: the same global batches, another split.
    _, straight = layout_run(runs, env, "dp2xcp2-ring")
    resumed_dir = resumed(runs, env, "resumed-cp4", 4, "--cp", "4", "--batch-size", "4")
    difference = max_difference(read_losses(straight), read_losses(resumed_dir))
    print(f"\nresume dp 2 x cp 2 -> dp 1 x cp 4 after step {HALF}: largest loss difference {difference:.1e}")
    assert difference <= 1e-5
    assert grad_norm_difference(straight, resumed_dir, clipped=True) <= GRAD_NORM_TOLERANCE


# What each mistake says: the flags, and a part of the one line. Checked by calling the chapter's checks in this
# process (every run of the script takes tens of seconds to start); test_a_bad_input_stops_every_rank_with_one_line
# runs a real job.
BAD_INPUTS = {
    "sequence the split cannot divide": (["--cp", "2", "--seq-length", "250"], "--seq-length 250 does not split into 4 "
                                         "equal chunks (--cp 2, load balancing on)"),
    "unbalanced split that does not divide": (["--cp", "3", "--seq-length", "256", "--cp-load-balance", "off"],
                                              "--seq-length 256 does not split into 3 equal chunks"),
    "all-to-all with more ranks than key/value heads": (["--cp", "8", "--cp-attention", "all-to-all"],
                                                        "4 key/value heads do not divide into --cp 8"),
    "all-to-all with a --cp that does not divide the key/value heads": (
        ["--cp", "3", "--cp-attention", "all-to-all", "--seq-length", "258"],
        "4 key/value heads do not divide into --cp 3"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_a_bad_input_gets_a_one_line_error(case):
    flags, expected = BAD_INPUTS[case]
    chapter = load_script("09")
    args = chapter.get_parser().parse_args(flags)
    with pytest.raises(SystemExit) as stopped:
        chapter.check_context_parallel(args, AutoConfig.from_pretrained(TINY_MODEL))
    message = str(stopped.value)
    assert message.startswith("error: ") and expected in message and "\n" not in message, message


def test_a_world_size_that_cp_does_not_divide_gets_a_one_line_error():
    with pytest.raises(SystemExit) as stopped:
        load_script("09").get_device_mesh(torch.device("cpu"), 4, 3)
    assert str(stopped.value) == "error: --cp 3 does not divide the world size 4; use a divisor of 4"


def test_a_bad_input_stops_every_rank_with_one_line(env, tmp_path):
    # After the process group and the mesh exist: every rank stops with the line, and the job ends.
    result, _ = train("09", env, tmp_path, "--max-steps", "2", "--cp", "2", "--seq-length", "250", nproc=2,
                      check=False, timeout=300)
    assert result.returncode == 1
    errors = sorted(set(error_lines(result.stderr)))
    assert errors == ["error: --seq-length 250 does not split into 4 equal chunks (--cp 2, load balancing on); use a "
                      "multiple of 4"], result.stderr[-3000:]
    assert f'File "{script("09")}"' not in result.stderr


def test_the_labels_are_shifted_before_the_split_and_the_count_covers_every_rank(monkeypatch):
    # One sequence 0..15 on 2 cp ranks, load-balanced: rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11. Each
    # token's label is the next token of the whole sequence, the last has none (-100), and the count is all 15.
    chapter = load_script("09")

    class Mesh:
        def __init__(self, rank, size):
            self.rank, self.size_ = rank, size

        def get_local_rank(self):
            return self.rank

        def size(self):
            return self.size_

        def get_group(self):
            return None

    input_ids = torch.arange(16).unsqueeze(0)
    # NOTE: one data-parallel rank, so the count's all-reduce has nothing to add: no process group needed.
    monkeypatch.setattr(chapter.dist, "all_reduce", lambda tensor, group=None: None)
    shares = [chapter.get_model_inputs(input_ids, Mesh(rank, 2), Mesh(0, 1), load_balance=True) for rank in (0, 1)]
    (ids_0, positions_0, labels_0, count_0), (ids_1, positions_1, labels_1, count_1) = shares
    assert ids_0.tolist() == positions_0.tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert labels_0.tolist() == [[1, 2, 3, 4, 13, 14, 15, -100]]
    assert ids_1.tolist() == positions_1.tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert labels_1.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert count_0.item() == count_1.item() == 15


def test_memory_per_rank_falls_as_one_over_cp_and_load_balancing_evens_the_work(env, tmp_path):
    figures_file = tmp_path / "figures.json"
    run([*torchrun(4), MEASURE, "--seq-lengths", "512", "1024", "--attention-seq-length", "1024", "--repeats", "1",
         "--json", figures_file], env, tmp_path, timeout=600)
    figures = json.loads(figures_file.read_text())
    memory = figures["activation_bytes"]
    print("\nactivation memory per rank (MB, batch 1): " + ", ".join(
        f"{key.replace('/', ' at ')} tokens: {value / 1e6:.1f}" for key, value in memory.items()))
    for seq_length in (512, 1024):
        for cp_size in (2, 4):
            ratio = memory[f"{cp_size}/{seq_length}"] / memory[f"1/{seq_length}"]
            assert abs(ratio - 1 / cp_size) <= 0.01 / cp_size, (seq_length, cp_size, ratio)
        # And it grows linearly with the sequence: no sequence x sequence matrix is kept.
    assert abs(memory["1/1024"] / memory["1/512"] - 2) <= 0.02
    attention = figures["attention"]
    print("ring attention, 1024 tokens, scores computed per rank: " + "; ".join(
        f"cp {key.replace('/', ', balancing ')}: {value['scores_computed']}" for key, value in attention.items()))
    for cp_size in (2, 4):
        balanced, unbalanced = attention[f"{cp_size}/on"]["scores_computed"], attention[f"{cp_size}/off"]["scores_computed"]
        local = 1024 // cp_size
        # Balanced: every rank its own causal block (computed whole) and cp - 1 half blocks.
        assert balanced == [local * local + (cp_size - 1) * local * local // 2] * cp_size
        # Unbalanced: rank i its own block and the i whole blocks before it; the same total, unevenly.
        assert unbalanced == [(rank + 1) * local * local for rank in range(cp_size)]
        assert sum(balanced) == sum(unbalanced)
    # Llama-3.1-8B on the meta device (the README's table): 7 MB per token, and per GPU exactly the cp-th part.
    llama_8b = figures["llama_8b_bytes"]
    print("Llama-3.1-8B activations per GPU (GB): " + ", ".join(
        f"cp {key.replace('/', ' at ')} tokens: {value / 1e9:.1f}" for key, value in llama_8b.items()))
    assert 6.5e6 <= llama_8b["1/8192"] / 8192 <= 7.5e6
    for seq_length in (8192, 32768, 131072):
        for cp_size in (8, 16):
            assert abs(llama_8b[f"{cp_size}/{seq_length}"] * cp_size / llama_8b[f"1/{seq_length}"] - 1) <= 1e-3


def probe_ring_attention(chapter, monkeypatch, tokens, dtype=torch.float32):
    """One forward and backward of the chapter's RingAttention as cp rank 0 of 2, load-balanced (its causal block,
    then half of rank 1's), under tools/measure_step.py's dispatch mode: {"OPERATOR(dtypes)": calls} of every matmul
    and attention operator, and the most bytes of tensor storage alive at once above the start, forward and backward
    (the CPU has no allocator statistics). NOTE: in one process, rank 1's keys and values are rank 0's own (the ring
    pass is a copy): the shapes, operators and memory are the real ring's, the values are not."""
    monkeypatch.setattr(chapter.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(chapter.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(chapter, "start_ring_pass", lambda tensor, group, tag: tensor.clone)
    generator = torch.Generator().manual_seed(0)
    # NOTE: the tiny Llama's heads, laid out as its attention passes them (a transpose of (batch, tokens, heads, dim)).
    query, key, value = (torch.randn(1, tokens, heads, 32, generator=generator).to(dtype).transpose(1, 2)
                         .requires_grad_() for heads in (8, 4, 4))
    grad_output = torch.randn(1, 8, tokens, 32, generator=generator).to(dtype)
    meter = StepMeter(None)
    meter.current = {"host_syncs": defaultdict(int), "matmuls": defaultdict(int), "in_forward_backward": True,
                     "peak_live_bytes": 0}
    with make_dispatch_mode(meter):
        meter.current["peak_live_bytes"] = start = meter.live_bytes
        chapter.RingAttention.apply(query, key, value, 32 ** -0.5, None, True).backward(grad_output)
    return dict(meter.current["matmuls"]), meter.current["peak_live_bytes"] - start


def test_ring_attention_runs_the_fused_kernel_and_never_holds_a_score_block(monkeypatch):
    # 2,048 tokens per rank: one fp32 block of scores, (batch, heads, queries, keys), would take 134 MB.
    tokens = 2048
    operators, peak = probe_ring_attention(load_script("09"), monkeypatch, tokens)
    score_block = 1 * 8 * tokens * tokens * 4
    print(f"\nring attention, cp rank 0 of 2, {tokens} tokens per rank, fp32: peak of live tensors forward and "
          f"backward {peak / 1e6:.1f} MB (one fp32 score block: {score_block / 1e6:.1f} MB); operators {operators}")
    # The causal block and the half block, forward and backward: the fused kernel and nothing else multiplies.
    assert operators == {"aten::_scaled_dot_product_flash_attention_for_cpu(float32, float32, float32)": 2,
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward(float32, float32, float32, "
                         "float32, float32, float32)": 2}, operators
    assert peak < score_block / 4, (peak, score_block)


def test_ring_attention_in_bf16_keeps_only_the_log_sum_exp_in_fp32(monkeypatch):
    operators, _ = probe_ring_attention(load_script("09"), monkeypatch, 256, torch.bfloat16)
    assert operators == {"aten::_scaled_dot_product_flash_attention_for_cpu(bfloat16, bfloat16, bfloat16)": 2,
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward(bfloat16, bfloat16, bfloat16, "
                         "bfloat16, bfloat16, float32)": 2}, operators


def readme_text():
    return README.read_text()


def test_the_readme_cpu_commands_train(env, tmp_path):
    commands = [shlex.split(line.strip()) for line in readme_text().splitlines()
                if line.strip().startswith("torchrun --standalone --nproc-per-node ")
                and f"{CHAPTERS['09']}/train_llm.py" in line]
    cpu_commands = [command for command in commands if "-m" not in command]
    assert cpu_commands, "the README shows no CPU command"
    # NOTE: each its own experiment: a later one would resume an earlier one's finished run and train nothing
    assert len({readme_experiment(command, "09") for command in cpu_commands}) == len(cpu_commands)
    # Each as written, from a scratch folder of its own and shortened to 2 steps of 64 tokens.
    for number, command in enumerate(cpu_commands):
        at = command.index(f"{CHAPTERS['09']}/train_llm.py")
        (tmp_path / str(number)).mkdir()
        result = run([*command[:at], script("09"), *command[at + 1:], "--max-steps", "2", "--seq-length", "64"], env,
                     tmp_path / str(number), timeout=600)
        assert [record["step"] for record in read_metrics(tmp_path / str(number) / "outputs" / readme_experiment(command, "09"))] == [2]
        assert f"rank {int(command[3]) - 1} of {command[3]}" in result.stdout and "done: step 2 of 2" in result.stdout


def test_the_readme_explains_every_definition_the_diff_adds_or_changes():
    base, chapter = (top_level_definitions(script(name).read_text()) for name in ("04", "09"))
    added = [name for name in chapter if name not in base]
    changed = list(LINEAGE["04", "09"])
    text = readme_text()
    # NOTE: the definitions only: the drift check's names include the docstring, the imports and section comments.
    names = dict.fromkeys(name for name in added + changed
                          if name.isidentifier() and name not in ("__doc__", "imports"))
    missing = [name for name in names if f"`{name}" not in text]
    assert not missing, f"the README does not name {missing}"


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("09", runs, env, family_models)
