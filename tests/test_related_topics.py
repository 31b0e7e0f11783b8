"""The experiments of related-topics/: two runs of chapter 01 with the same seed are bitwise equal and another seed
differs (determinism.md); a stopped and resumed job is one wandb run, logged by rank 0 (wandb.md)."""

import re
import sys

import torch

from helpers import read_metrics, run, train

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
