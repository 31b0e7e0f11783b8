"""The experiments of related-topics/: two runs of chapter 01 with the same seed are bitwise equal and another seed
differs (determinism.md); the same tokens in larger steps need a larger learning rate
(batch-size-and-learning-rate.md); accumulated micro-batches train as the larger batch, unless their labels differ
(gradient-accumulation.md); the corpus is tokenized once, by rank 0, and the workers keep the order
(data-loading.md); pure bf16 weights lose the updates fp32 master weights keep (mixed-precision.md); a stopped and
resumed job is one wandb run, logged by rank 0 (wandb.md); a run stopped by SIGUSR1 exits 0 with a checkpoint of the
step it stopped at, and resumes the same curve (preemption.md); the elastic restart's commands keep the global batch
(elastic-training.md, run by test_04)."""

import re
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import (REPO, TINY_MODEL, load_script, logged_step, max_difference, read_losses, read_metrics, run, train,
                     train_until_signalled)

sys.path.insert(0, str(REPO / "dev"))
import make_figures  # noqa: E402

# NOTE: chapter 01's reference run of test_01's gradient accumulation test: the same arguments, made once a session.
SAME_RUN = ["--max-steps", "6", "--wandb-mode", "disabled", "--batch-size", "4"]


def curve(experiment_dir):
    return [(record["step"], record["loss"], record["grad_norm"]) for record in read_metrics(experiment_dir)]


def final_weights(experiment_dir):
    return torch.load(experiment_dir / "checkpoint-00000006" / "model.pt", map_location="cpu", weights_only=True)


def test_the_same_seed_gives_bitwise_equal_runs_and_another_seed_does_not(env, runs, tmp_path):
    _, first = runs.train("01", env, *SAME_RUN)
    _, again = train("01", env, tmp_path, *SAME_RUN, experiment="again")
    _, other_seed = train("01", env, tmp_path, *SAME_RUN, "--seed", "1", experiment="seed-1")
    assert [step for step, _, _ in curve(first)] == list(range(1, 7))
    # NOTE: ==, not a tolerance: the same float32 operations in the same order round the same way.
    assert curve(again) == curve(first)
    weights, weights_again = final_weights(first), final_weights(again)
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)
    # Another seed: other initial weights and another sample order, so every step's loss and norm differ.
    assert all(loss != other_loss and norm != other_norm for (_, loss, norm), (_, other_loss, other_norm)
               in zip(curve(first), curve(other_seed), strict=True))
    assert not any(torch.equal(weights[name], final_weights(other_seed)[name])
                   for name in weights if not name.endswith("norm.weight"))



def test_a_run_stopped_by_sigusr1_exits_0_with_its_step_saved_and_resumes_the_same_curve(env, runs, tmp_path):
    """preemption.md's experiment, shortened: `kill -USR1` to chapter 01 once it has logged step 2, then the same
    command again."""
    _, straight = runs.train("01", env, *SAME_RUN)
    result, experiment, seconds = train_until_signalled("01", env, tmp_path, *SAME_RUN, to="launcher",
                                                        signals=[(logged_step(2), signal.SIGUSR1)])
    stopped = read_metrics(experiment)[-1]["step"]
    print(f"\nSIGUSR1 after step 2: stopped at step {stopped}, exit {result.returncode} {seconds:.1f}s after it")
    assert result.returncode == 0 and 2 < stopped < 6
    assert [path.name for path in experiment.glob("*checkpoint-*")] == [f"checkpoint-{stopped:08d}"]
    result, resumed = train("01", env, tmp_path, *SAME_RUN, experiment="signalled")
    assert f"resumed from {resumed / f'checkpoint-{stopped:08d}'} at step {stopped}" in result.stdout
    assert max_difference(read_losses(straight), read_losses(resumed)) <= 1e-6


def offline_runs(experiment_dir):
    return sorted(path.name for path in (experiment_dir / "wandb").glob("offline-run-*"))


def test_a_stopped_and_resumed_job_is_one_wandb_run_logged_by_rank_0(env, tmp_path):
    """wandb.md's experiment, shortened: each start writes an offline run folder with the experiment's id, which
    `wandb sync` would upload into one run; a 2-process job writes one folder, not one per rank."""
    offline = {**env, "WANDB_MODE": "offline"}
    tracked = ["--max-steps", "4", "--log-freq", "1", "--wandb-mode", "offline"]
    train("01", offline, tmp_path, *tracked, "--exit-after-steps", "2", experiment="tracked")
    _, experiment = train("01", offline, tmp_path, *tracked, experiment="tracked")
    run_id = (experiment / "wandb_run_id.txt").read_text().strip()
    folders = offline_runs(experiment)
    assert len(folders) == 2 and all(folder.endswith(f"-{run_id}") for folder in folders), folders
    assert [record["step"] for record in read_metrics(experiment)] == [1, 2, 3, 4]
    listed = run([sys.executable, "-m", "wandb", "sync", "--dry-run", experiment / "wandb"], offline, tmp_path)
    run_files = re.findall(r"run-(\w+)\.wandb", listed.stdout + listed.stderr)
    assert run_files == [run_id, run_id], listed.stdout + listed.stderr
    _, job = train("02", offline, tmp_path, *tracked, nproc=2, experiment="job")
    assert len(offline_runs(job)) == 1


def test_accumulated_micro_batches_are_the_larger_batch_unless_their_labels_differ(env, tmp_path):
    """gradient-accumulation.md: 8 sequences at once and 4 micro-batches of 2 train alike; with masked labels the mean
    of per-sequence means is not the mean over labelled tokens, which num_items_in_batch gives."""
    steps = ["--max-steps", "6", "--wandb-mode", "disabled"]
    _, at_once = train("01", env, tmp_path, *steps, "--batch-size", "8", experiment="batch-8")
    _, accumulated = train("01", env, tmp_path, *steps, "--batch-size", "2", "--grad-accum", "4", experiment="accum-4")
    assert max_difference(read_losses(at_once), read_losses(accumulated)) <= 1e-6
    assert all(abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"]
               for a, b in zip(read_metrics(at_once), read_metrics(accumulated), strict=True))

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), attn_implementation="sdpa")
    input_ids = torch.randint(0, model.config.vocab_size, (2, 64))
    labels = torch.full_like(input_ids, -100)
    labels[0, -3:], labels[1, -40:] = input_ids[0, -3:], input_ids[1, -40:]  # NOTE: 3 and 40 answer tokens
    with torch.no_grad():
        means = [model(input_ids=input_ids[i:i + 1], labels=labels[i:i + 1]).loss for i in range(2)]
        over_tokens = model(input_ids=input_ids, labels=labels).loss
        summed = [model(input_ids=input_ids[i:i + 1], labels=labels[i:i + 1], num_items_in_batch=torch.tensor(43)).loss
                  for i in range(2)]
    assert abs((means[0] + means[1]) / 2 - over_tokens) > 1e-3
    assert torch.allclose(summed[0] + summed[1], over_tokens, atol=1e-6)


def test_the_same_tokens_in_4_times_larger_steps_need_a_larger_learning_rate(env, tmp_path):
    """batch-size-and-learning-rate.md's commands: 64 steps of 2 sequences, then the same 128 in 16 steps of 8. On the
    last 16 sequences, batch 8 at the base lr ends above batch 2, and at sqrt(4) times it recovers part of the gap."""
    common = ["--wandb-mode", "disabled", "--seq-length", "64", "--log-freq", "1"]
    runs = {name: read_losses(train("01", env, tmp_path, *common, *flags, experiment=name)[1]) for name, flags in {
        "batch-2": ["--batch-size", "2", "--max-steps", "64", "--warmup-steps", "4"],
        "batch-8": ["--batch-size", "8", "--max-steps", "16", "--warmup-steps", "1"],
        "batch-8-sqrt": ["--batch-size", "8", "--max-steps", "16", "--warmup-steps", "1", "--lr", "2e-3"]}.items()}
    last = {name: sum(losses[-len(losses) // 8:]) / (len(losses) // 8) for name, losses in runs.items()}
    assert [len(losses) for losses in runs.values()] == [64, 16, 16]
    assert last["batch-8"] - last["batch-8-sqrt"] >= 0.05, last
    assert last["batch-2"] < last["batch-8-sqrt"], last


def test_the_corpus_is_tokenized_once_by_rank_0_and_the_workers_keep_the_order(env, tmp_path):
    """data-loading.md: a run that finds no cache tokenizes, the next reads it; another --seq-length gets its own
    folder; --num-workers 0 and 2 train alike; in a 2-rank job only rank 0 tokenizes.

    NOTE: sequence lengths no other test uses, in the session's cache: a fresh HF_HOME would start every process cold.
    """
    cache = Path(env["HF_HOME"]) / "datasets" / "train_llm"
    folders = set(cache.iterdir()) if cache.exists() else set()
    steps = ["--max-steps", "3", "--wandb-mode", "disabled", "--seq-length", "44"]
    first, no_workers = train("01", env, tmp_path, *steps, "--num-workers", "0", experiment="workers-0")
    again, two_workers = train("01", env, tmp_path, *steps, "--num-workers", "2", experiment="workers-2")
    assert "INFO tokenizing" in first.stdout and "INFO tokenizing" not in again.stdout
    assert curve(no_workers) == curve(two_workers)
    assert len(set(cache.iterdir()) - folders) == 1
    train("01", env, tmp_path, *steps, "--seq-length", "40", experiment="shorter")
    assert len(set(cache.iterdir()) - folders) == 2
    job, _ = train("02", env, tmp_path, *steps, "--seq-length", "52", nproc=2, experiment="job")
    assert re.findall(r"\[rank (\d)\] INFO tokenizing", job.stdout) == ["0"]


def test_pure_bf16_weights_lose_the_updates_that_fp32_master_weights_keep():
    """mixed-precision.md: one batch memorized for 20 steps in fp32, with autocast (fp32 weights) and in pure bf16
    (dev/make_figures.py's experiment, which draws the page's figure)."""
    results = {}
    for mode in make_figures.MIXED_PRECISION_MODES:
        losses, unchanged = make_figures.memorize_one_batch(mode)
        results[mode] = (losses[-1], unchanged)
        print(f"\n{mode}: final loss {results[mode][0]:.3f}, norm scales unchanged {results[mode][1]:.0%}", end="")
    # NOTE: an update of ~1e-3 is below half of bf16's spacing at 1.0 (2^-8 below, 2^-7 above): rounded away
    assert results["pure bf16"][1] == 1.0 and results["fp32"][1] == results["autocast"][1] == 0.0
    assert results["pure bf16"][0] > results["fp32"][0] and abs(results["autocast"][0] - results["fp32"][0]) < 0.05


@pytest.mark.quick
def test_the_elastic_page_s_commands_keep_the_global_batch_and_name_the_test_that_runs_them():
    """elastic-training.md's two CPU commands (2 ranks, then 3 with the same flags) set 3 and then 2 micro-batches of
    a global batch of 6, and the test that runs them exists in test_04."""
    from types import SimpleNamespace

    page = (REPO / "related-topics" / "elastic-training.md").read_text()
    commands = [line.split() for line in page.splitlines() if line.startswith("torchrun --standalone")]
    assert [command[3] for command in commands] == ["2", "3"]
    grad_accum_steps = load_script("04").grad_accum_steps
    for command in commands:
        options = dict(zip(command[5::2], command[6::2]))
        assert options["-e"] == "elastic"
        args = SimpleNamespace(global_batch_size=int(options["--global-batch-size"]),
                               batch_size=int(options["--batch-size"]), grad_accum=1)
        assert grad_accum_steps(args, int(command[3])) * int(command[3]) * args.batch_size == 6
    test_name = re.search(r"::(test_\w+)`", page).group(1)
    assert f"def {test_name}(" in (REPO / "tests" / "test_04_fully_sharded_data_parallel.py").read_text()
