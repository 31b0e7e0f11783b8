"""What every test file shares: where the chapters are, how to run them, how to read what they logged.

Every process a test starts runs in a session of its own with a deadline, and the whole session is killed when the
test is done with it, so a hung or crashed distributed job never outlives its test.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = {
    "01": "01-single-gpu",
    "02": "02-distributed-data-parallel",
    "03": "03-job-launchers",
    "04": "04-fully-sharded-data-parallel",
    "05": "05-training-llama-405b",
    "06": "06-tensor-parallel",
    "07": "07-2d-parallel",
}
TINY_MODEL = REPO / "data" / "tiny-llama"

# Small and fast: a 10-step run takes a few seconds on one CPU core.
FAST_ARGS = ["--seq-length", "64", "--batch-size", "4", "--log-freq", "1", "--ckpt-freq", "1000",
             "--warmup-steps", "2", "--num-workers", "0"]


def script(chapter):
    return REPO / CHAPTERS[chapter] / "train_llm.py"


def run(command, env, cwd, timeout=300, check=True):
    """Run a command in its own process session; kill the whole session when it ends or overruns."""
    process = subprocess.Popen([str(part) for part in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {command}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}")
    finally:
        kill_session(process.pid)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {command}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}")
    return result


def kill_session(session_id):
    try:
        os.killpg(session_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def torchrun(nproc, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc, *extra]


def train(chapter, env, workdir, *args, nproc=None, experiment="run", timeout=300, check=True, launcher=None):
    """Run a chapter's script on the tiny model with FAST_ARGS; returns (result, experiment directory).

    nproc=None runs one plain process; a number runs torchrun --standalone with that many processes.
    """
    if launcher is None:
        launcher = [sys.executable] if nproc is None else torchrun(nproc)
    command = [*launcher, script(chapter), *FAST_ARGS, "--save-dir", workdir / "outputs", "-e", experiment, *args]
    result = run(command, env, workdir, timeout=timeout, check=check)
    return result, Path(workdir) / "outputs" / experiment


def read_metrics(experiment_dir):
    """The last record logged for each step (a resumed run may log a step again)."""
    records = {}
    for line in (Path(experiment_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records[record["step"]] = record
    return [records[step] for step in sorted(records)]


def read_losses(experiment_dir):
    return [record["loss"] for record in read_metrics(experiment_dir)]


def max_difference(losses_a, losses_b):
    assert len(losses_a) == len(losses_b), f"{len(losses_a)} vs {len(losses_b)} steps"
    return max(abs(a - b) for a, b in zip(losses_a, losses_b))


def error_line(result):
    """The one line a failed run printed last on stderr."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""
