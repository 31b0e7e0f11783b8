"""Chapter 01: the quick start trains, resume and gradient accumulation are exact, saves survive crashes,
and bad input gets a one-line error."""

import ast
import json
import re
import shutil
import signal
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from helpers import (CHAPTERS, GRAD_NORM_TOLERANCE, NO_CLIPPING, QUICK_START_STEPS, REPO, TINY_MODEL, cold_start,
                     error_line, grad_norm_difference, load_script, logged_step, max_difference, printed, read_losses,
                     read_metrics, script, train, train_until_signalled, with_faults, check_family_matrix)



@pytest.mark.last
def test_quick_start_command_trains_and_the_loss_falls(quick_start):
    # The README's command, stopped after its first QUICK_START_STEPS (the 200-step schedule's), started with the
    # session. Its step 10 is the line 01's README shows; from there the loss falls (7.36 to 5.85 at step 60).
    result = quick_start.wait(timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(quick_start.cwd / "outputs" / CHAPTERS["01"])
    readme = (REPO / CHAPTERS["01"] / "README.md").read_text()
    shown = re.search(r"INFO step 10 \| loss ([\d.]+) \| lr ([\de.-]+) ", readme)
    print(f"quick start: loss {records[0]['loss']:.4f} at step 10 (the README's {shown[1]}) -> "
          f"{records[-1]['loss']:.4f} at step {records[-1]['step']}")
    assert [record["step"] for record in records] == list(range(10, QUICK_START_STEPS + 1, 10))
    assert f"done: step {QUICK_START_STEPS} of 200" in result.stdout
    assert abs(records[0]["loss"] - float(shown[1])) <= 2e-3 and f"{records[0]['lr']:.2e}" == shown[2]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    assert "tokens/s" in result.stdout and "MFU n/a" in result.stdout


def test_a_crash_with_a_dataloader_worker_exits_instead_of_hanging(env, tmp_path):
    # NOTE: the worker ignores SIGTERM (catch_stop_signals); without the data closed at exit, Python's exit sends it
    # SIGTERM and waits for it forever. Cold: a warm-started process leaves without Python's exit.
    fault_env = with_faults(cold_start(env), FAULT_RAISE_AFTER_STEPS="2")
    result, _ = train("01", fault_env, tmp_path, "--max-steps", "1000", "--num-workers", "1", check=False, timeout=60)
    assert result.returncode == 1 and "injected fault on rank 0 after 2 optimizer steps" in result.stderr


def test_resume_is_exact(env, tmp_path):
    # Clipping does not bind here (NO_CLIPPING): the gradients of the resumed steps are applied as computed.
    _, straight = train("01", env, tmp_path, "--max-steps", "8", *NO_CLIPPING, experiment="straight")
    train("01", env, tmp_path, "--max-steps", "8", *NO_CLIPPING, "--exit-after-steps", "4", experiment="resumed")
    assert [path.name for path in (tmp_path / "outputs" / "resumed").glob("checkpoint-*")] == ["checkpoint-00000004"]
    result, resumed = train("01", env, tmp_path, "--max-steps", "8", *NO_CLIPPING, experiment="resumed")
    assert "resumed from" in result.stdout
    assert max_difference(read_losses(straight), read_losses(resumed)) <= 1e-6
    assert grad_norm_difference(straight, resumed, clipped=False) <= 1e-6
    assert_same_weights(straight / "checkpoint-00000008", resumed / "checkpoint-00000008", tolerance=1e-6)


@pytest.mark.quick
def test_gradient_accumulation_is_exact(env, runs, tmp_path):
    # NOTE: the whole batch's run is the reference run of chapters 07 and 11 (the same arguments), made once.
    _, whole = runs.train("01", env, "--max-steps", "6", "--wandb-mode", "disabled", "--batch-size", "4")
    _, accumulated = train("01", env, tmp_path, "--max-steps", "6", "--batch-size", "2", "--grad-accum", "2",
                           experiment="accumulated")
    assert max_difference(read_losses(whole), read_losses(accumulated)) <= 1e-5
    # Clipping at the default 1.0 binds at every step: the norm is what shows micro-batch gradients left unaveraged.
    assert grad_norm_difference(whole, accumulated, clipped=True) <= GRAD_NORM_TOLERANCE
    # NOTE: the two runs sum the same gradients in a different order, so they differ by rounding (1e-7 relative).
    # AdamW divides each gradient by its own running size: where a gradient is near zero (a rare token's embedding
    # row) a rounding difference moves that weight by a visible part of a step (lr 1e-3), and a different CPU moves
    # a different handful. A real accumulation bug moves almost every weight, so the test bounds both: nearly every
    # weight equal to 1e-6, and the few others within 5% of one step.
    weights_whole = checkpoint_model_weights(whole / "checkpoint-00000006")
    weights_accumulated = checkpoint_model_weights(accumulated / "checkpoint-00000006")
    differences = torch.cat([(weights_whole[name] - weights_accumulated[name]).abs().flatten() for name in weights_whole])
    apart = (differences > 1e-6).sum().item()
    print(f"\ngradient accumulation: {apart} of {differences.numel()} weights differ by more than 1e-6, the largest by "
          f"{differences.max().item():.1e}")
    assert apart <= 1e-4 * differences.numel()
    assert differences.max().item() <= 5e-5


def test_a_crash_during_a_save_keeps_the_previous_checkpoint(env, tmp_path):
    _, straight = train("01", env, tmp_path, "--max-steps", "8", experiment="straight")
    # A checkpoint is three torch.save calls; the 5th call is the second file of the step-8 checkpoint.
    crash_env = with_faults(env, FAULT_KILL_ON_CALL="torch.save:5")
    result, crashed = train("01", crash_env, tmp_path, "--max-steps", "8", "--ckpt-freq", "4", experiment="crashed",
                            check=False)
    assert result.returncode == -9
    assert sorted(path.name for path in crashed.iterdir() if "checkpoint" in path.name) == [
        "checkpoint-00000004", "tmp-checkpoint-00000008"]
    result, resumed = train("01", env, tmp_path, "--max-steps", "8", experiment="crashed")
    assert "resumed from" in result.stdout and "checkpoint-00000004" in result.stdout
    assert max_difference(read_losses(straight), read_losses(resumed)) <= 1e-6


# NOTE: test_gradient_accumulation_is_exact's reference run: the same arguments, made once a session.
SIX_STEPS = ["--max-steps", "6", "--wandb-mode", "disabled", "--batch-size", "4"]


def test_a_signal_during_the_first_step_checkpoints_that_step_exits_0_and_resumes_the_same_curve(env, runs, tmp_path):
    # Slurm's --signal=USR1@120: SIGUSR1 while step 1 runs (held 2 s inside its gradient clipping by a fault).
    _, straight = runs.train("01", env, *SIX_STEPS)
    slow_step = with_faults(env, FAULT_SLEEP_ON_CALL="torch.nn.utils.clip_grad_norm_:2")
    result, signalled, seconds = train_until_signalled(
        "01", slow_step, tmp_path, *SIX_STEPS, signals=[(printed("injected fault"), signal.SIGUSR1)])
    print(f"SIGUSR1 in step 1 to exit: {seconds:.1f}s")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [record["step"] for record in read_metrics(signalled)] == [1]
    assert [path.name for path in signalled.glob("*checkpoint-*")] == ["checkpoint-00000001"]
    result, resumed = train("01", env, tmp_path, *SIX_STEPS, experiment="signalled")
    assert f"resumed from {resumed / 'checkpoint-00000001'} at step 1" in result.stdout
    assert max_difference(read_losses(straight), read_losses(resumed)) <= 1e-6


def test_more_signals_during_the_save_leave_it_complete(env, tmp_path):
    # SIGTERM once step 2 is logged; the save of the step it stops at is held 2 s in its first torch.save, and gets
    # a SIGUSR1 and a SIGTERM: it completes, and the run exits 0.
    slow_save = with_faults(env, FAULT_SLEEP_ON_CALL="torch.save:2")
    saving = printed("before torch.save")
    result, signalled, _ = train_until_signalled(
        "01", slow_save, tmp_path, "--max-steps", "10", signals=[(logged_step(2), signal.SIGTERM),
                                                                  (saving, signal.SIGUSR1), (saving, signal.SIGTERM)])
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = read_metrics(signalled)[-1]["step"]
    assert 2 < stopped < 10 and f"done: step {stopped} of 10" in result.stdout
    assert [path.name for path in signalled.glob("*checkpoint-*")] == [f"checkpoint-{stopped:08d}"]
    saved = {name: torch.load(signalled / f"checkpoint-{stopped:08d}" / name, map_location="cpu", weights_only=True)
             for name in ["model.pt", "optimizer.pt", "train_state.pt"]}
    assert saved["train_state.pt"]["step"] == stopped and saved["optimizer.pt"]["state"] and saved["model.pt"]


def test_a_checkpoint_saved_on_gpu_0_resumes_on_this_device(env, tmp_path, monkeypatch):
    # A GPU run's checkpoint: every tensor of model.pt and optimizer.pt tagged cuda:0 when it is written, as rank 0
    # of a GPU job writes them. torch.load restores a tensor to the device of its tag unless told otherwise: on a
    # GPU node every rank would fill GPU 0, and here, with no GPU at all, the load fails.
    _, experiment = train("01", env, tmp_path, "--max-steps", "4", "--exit-after-steps", "2")
    monkeypatch.setattr(torch.serialization, "_package_registry", list(torch.serialization._package_registry))
    torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
    for name in ["model.pt", "optimizer.pt"]:
        path = experiment / "checkpoint-00000002" / name
        torch.save(torch.load(path, map_location="cpu", weights_only=True), path)
    assert b"cuda:0" in (experiment / "checkpoint-00000002" / "model.pt").read_bytes()
    result, _ = train("01", env, tmp_path, "--max-steps", "4")
    assert "resumed from" in result.stdout and "done: step 4 of 4" in result.stdout


def test_training_builds_no_kv_cache(env, tmp_path):
    # A KV cache (DynamicCache) only serves generation. The fault kills the process as soon as one is built, which
    # a Hugging Face model does in every forward pass unless it is called with use_cache=False.
    fault_env = with_faults(env, FAULT_KILL_ON_CALL="transformers.cache_utils.DynamicCache.__init__:1")
    result, _ = train("01", fault_env, tmp_path, "--max-steps", "2", check=False)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert "done: step 2 of 2" in result.stdout


def test_flops_per_token_use_the_head_dim_of_the_config():
    # Qwen3-style heads that are not hidden_size / heads wide (32, not 16), as Qwen3-32B's (128, not 5120 / 64) are.
    chapter = load_script("01")
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    matmul_weights = sum(p.numel() for p in model.parameters()) - 256 * 64
    assert chapter.get_flops_per_token(model, config, 128) == 6 * matmul_weights + 12 * 2 * 4 * 32 * 128


@pytest.mark.parametrize("name, peak", [("NVIDIA L4", 121e12), ("NVIDIA L40", 181e12), ("NVIDIA L40S", 362e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H200 NVL", 835e12), ("NVIDIA H200", 989e12)])
def test_the_peak_flops_of_a_gpu_follow_its_whole_name(monkeypatch, name, peak):
    chapter = load_script("01")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert chapter.get_peak_flops(torch.device("cuda"), torch.bfloat16) == peak


def pretend_gpus(monkeypatch, count, states):
    """torch.cuda's random-state functions on a machine with `count` visible GPUs; states: {GPU index: state}."""
    def index(device):
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if index >= count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        return index

    def set_state(state, device="cuda"):
        states[index(device)] = state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[index(device)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[i] for i in range(count)])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda all_states: [set_state(state, i)
                                                                             for i, state in enumerate(all_states)])


def test_the_cuda_random_state_resumes_with_fewer_visible_gpus(monkeypatch):
    # Saved by a process that saw 8 GPUs and used GPU 0; resumed by one that sees a single GPU.
    chapter = load_script("01")
    saved_on = {index: torch.full((16,), index, dtype=torch.uint8) for index in range(8)}
    pretend_gpus(monkeypatch, 8, saved_on)
    rng_state = chapter.get_rng_state()
    resumed_on = {0: torch.full((16,), 99, dtype=torch.uint8)}
    pretend_gpus(monkeypatch, 1, resumed_on)
    chapter.set_rng_state(rng_state)
    assert torch.equal(resumed_on[0], saved_on[0])


def make_incompatible_model(tmp_path):
    model_dir = tmp_path / "wider-llama"
    shutil.copytree(TINY_MODEL, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["hidden_size"] = 128
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def make_sliding_window_model(tmp_path, window):
    """The tiny model as a Mistral (the same weights' names), whose attention slides over `window` tokens."""
    model_dir = tmp_path / f"mistral-window-{window}"
    shutil.copytree(TINY_MODEL, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def make_tiny_dataset(tmp_path):
    path = tmp_path / "tiny.jsonl"
    # About 150 tokens: two sequences of 64, where one optimizer step of FAST_ARGS needs four.
    path.write_text(json.dumps({"text": "To be, or not to be, that is the question. " * 12}) + "\n")
    return path


BAD_INPUTS = {
    "missing model": (lambda tmp: ["-m", str(tmp / "no-such-model")], "cannot load -m "),
    "missing dataset": (lambda tmp: ["-d", str(tmp / "no-such-data")], "cannot load -d "),
    "sequence too long": (lambda tmp: ["--seq-length", "4096"], "exceeds the model's 1024 positions"),
    "dataset too small": (lambda tmp: ["-d", str(make_tiny_dataset(tmp))], "are fewer than one step's 4"),
    "zero batch size": (lambda tmp: ["--batch-size", "0"], "--batch-size must be at least 1"),
    "sliding window shorter than the sequence": (lambda tmp: ["-m", str(make_sliding_window_model(tmp, 32))],
                                                 "--seq-length 64 exceeds the model's sliding window 32"),
    "missing text column": (lambda tmp: ["--text-column", "content"], "no text column 'content'"),
    "empty file": (lambda tmp: ["-d", str(write(tmp / "empty.jsonl", ""))], "(it holds no data)"),
    "fewer tokens than a sequence": (lambda tmp: ["-d", str(write(tmp / "one.txt", "To be, or not to be.\n"))],
                                     "has under --seq-length 64 tokens; use more data"),
    "folder without data files": (lambda tmp: ["-d", str(write(tmp / "notes" / "notes.md", "# notes").parent)],
                                  "pass a hub name, or .jsonl"),
    "another format than its extension": (lambda tmp: ["-d", str(write(tmp / "data.jsonl", "text\nhello\n"))],
                                          "(JSON parse error"),
    "a column of numbers": (lambda tmp: ["-d", str(write(tmp / "numbers.jsonl", '{"text": 5}\n'))],
                            "no text column 'text' (columns: {'text': 'int64'})"),
    "one malformed line among good ones": (lambda tmp: ["-d", str(write(tmp / "one-bad.jsonl", '{"text": "To be"}\n'
                                                                         * 40 + '{"text": "or not\n'))],
                                           "(JSON parse error"),
}


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gets_a_one_line_error(env, tmp_path, case):
    make_args, expected = BAD_INPUTS[case]
    result, _ = train("01", env, tmp_path, "--max-steps", "2", *make_args(tmp_path), check=False, timeout=120)
    assert result.returncode == 1
    assert error_line(result).startswith("error: ") and expected in error_line(result), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def fp32_attention_check(chapter):
    """The statement of a chapter's main() that refuses fp32 attention on CUDA without a fused kernel, and its source."""
    source = script(chapter).read_text()
    main = next(node for node in ast.parse(source).body if getattr(node, "name", None) == "main")
    check, = [node for node in main.body if "fused_attention_runs" in ast.get_source_segment(source, node)]
    built = next(node for node in main.body if "from_config" in ast.get_source_segment(source, node))
    assert check.lineno < built.lineno, f"chapter {chapter} checks after building the model"
    return check, ast.get_source_segment(source, check)


@pytest.mark.quick
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_chapter_refuses_fp32_attention_without_a_fused_kernel_on_cuda_before_the_model(chapter):
    """On CUDA, torch 2.11 ran fp32 attention with fewer key/value than query heads only in SDPA's math kernel, which
    keeps every head's S x S score matrix (measured on an H200, 01's README): the same check in every chapter, ahead
    of the model, asks the installed torch (fused_attention_runs) and refuses exactly when it says no."""
    check, text = fp32_attention_check(chapter)
    assert text == fp32_attention_check("01")[1]
    code = compile(ast.Module([check], []), script(chapter), "exec")
    grouped, multi_head = (SimpleNamespace(num_attention_heads=32, num_key_value_heads=kv) for kv in (8, 32))
    require = load_script(chapter).require
    asked = []

    def run_check(device, dtype, config):
        # NOTE: torch 2.11's answer: a fused kernel only for equal heads.
        def like_torch_2_11(config, device, dtype):
            asked.append(dtype)
            return config.num_key_value_heads == config.num_attention_heads
        exec(code, {"require": require, "torch": torch, "device": torch.device(device), "dtype": dtype,
                    "config": config, "fused_attention_runs": like_torch_2_11})

    for allowed in [("cpu", torch.float32, grouped), ("cuda", torch.bfloat16, grouped),
                    ("cuda", torch.float32, multi_head)]:
        run_check(*allowed)
    with pytest.raises(SystemExit, match="^error: --dtype float32 on CUDA: .* use --dtype bfloat16 or auto$"):
        run_check("cuda", torch.float32, grouped)
    assert asked == [torch.float32, torch.float32], "torch is asked about fp32 on CUDA only"


def test_fused_attention_runs_asks_torch_about_the_call_transformers_makes(monkeypatch):
    # NOTE: transformers' SDPA passes enable_gqa=True and no mask on CUDA (use_gqa_in_sdpa); the chapters, is_causal.
    chapter = load_script("01")
    config = SimpleNamespace(num_attention_heads=8, num_key_value_heads=4, hidden_size=256)
    seen = []
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda params: seen.append(params) or False)
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda params: False)
    assert not chapter.fused_attention_runs(config, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", lambda params: True)
    assert chapter.fused_attention_runs(config, torch.device("cpu"), torch.float32)
    params, = seen
    assert params.query.shape[1] == 8 and params.key.shape[1] == params.value.shape[1] == 4
    assert params.query.shape[-1] == 32 and params.query.dtype == torch.float32
    assert params.enable_gqa and params.is_causal and params.attn_mask is None and params.dropout == 0.0


def test_fp32_on_a_pretended_gpu_gets_a_one_line_error_before_the_model_is_built(monkeypatch, tmp_path):
    # The tiny model has 8 query and 4 key/value heads; main() stops before anything touches the (absent) GPU.
    chapter = load_script("01")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(chapter, "fused_attention_runs", lambda config, device, dtype: False)
    monkeypatch.setattr(sys, "argv", ["train_llm.py", "--dtype", "float32", "--save-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="^error: --dtype float32 on CUDA: no fused attention kernel takes the model's"):
        chapter.main()


def test_a_sliding_window_model_trains_while_its_window_covers_every_sequence(env, tmp_path):
    # NOTE: the refusal above is no wider than the problem: a window as long as the sequence is full causal attention.
    result, experiment = train("01", env, tmp_path, "--max-steps", "2", "-m", make_sliding_window_model(tmp_path, 64))
    assert "MistralForCausalLM" in (experiment / "checkpoint-00000002" / "model_config.json").read_text()
    assert len(read_losses(experiment)) == 2


def test_a_checkpoint_of_another_model_gets_a_one_line_error(env, tmp_path):
    train("01", env, tmp_path, "--max-steps", "1", experiment="shared-name")
    result, _ = train("01", env, tmp_path, "--max-steps", "2", "-m", make_incompatible_model(tmp_path),
                      experiment="shared-name", check=False)
    assert result.returncode == 1
    assert error_line(result).startswith("error: the checkpoint") and "hidden_size 256 vs 128" in error_line(result)


def checkpoint_model_weights(checkpoint):
    return torch.load(checkpoint / "model.pt", map_location="cpu", weights_only=True)


def assert_same_weights(checkpoint_a, checkpoint_b, tolerance):
    weights_a, weights_b = checkpoint_model_weights(checkpoint_a), checkpoint_model_weights(checkpoint_b)
    assert weights_a.keys() == weights_b.keys()
    largest = max((weights_a[name] - weights_b[name]).abs().max().item() for name in weights_a)
    assert largest <= tolerance, f"weights differ by {largest}"


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("01", runs, env, family_models)
