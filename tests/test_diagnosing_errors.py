"""diagnosing-errors: each broken program fails the way the README says, and each tool finds the fault.

The README's `bash` commands run here exactly as written, from a scratch folder that links diagnosing-errors/,
so their outputs/ land under tmp_path. Every job runs in a session of its own with a deadline. torchrun puts
its workers in sessions of their own, so a job is stopped with SIGTERM to torchrun (which stops its workers),
then whatever still carries the test's marker is killed.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

from helpers import processes_with_marker
from helpers import REPO, cold_start, free_port

CHAPTER = REPO / "diagnosing-errors"

PREFLIGHT = "torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/preflight.py"
PREFLIGHT_ALONE = ("RANK=0 WORLD_SIZE=2 MASTER_ADDR=localhost MASTER_PORT=29555 "
                   "python diagnosing-errors/tools/preflight.py --timeout 5")
EXTRA = "torchrun --standalone --nproc-per-node 3 diagnosing-errors/broken/extra_allreduce.py"
CONDITIONAL = "torchrun --standalone --nproc-per-node 3 diagnosing-errors/broken/rank_conditional.py"
DUMP = "python diagnosing-errors/tools/dump_hang.py"
EXTRA_FR = ("TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=outputs/fr/rank_ torchrun --standalone "
            "--nproc-per-node 3 diagnosing-errors/broken/extra_allreduce.py --timeout 5")
FRTRACE = "torchfrtrace outputs/fr"
SHAPE_LOGS = ("torchrun --standalone --nproc-per-node 2 --log-dir outputs/logs --tee 3 "
              "diagnosing-errors/broken/shape_mismatch.py")
SHAPE_DETAIL = ("TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 "
                "diagnosing-errors/broken/shape_mismatch.py")
BANDWIDTH = ("torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/collective_bandwidth.py --max-bytes 8K "
             "--iters 2")
NAN = "torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/nan_midway.py"
NAN_WATCH = ("torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/nan_watch.py "
             "diagnosing-errors/broken/nan_midway.py")
DOWNLOADS = "torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/everyone_downloads.py"
TESTED = {PREFLIGHT, PREFLIGHT_ALONE, EXTRA, CONDITIONAL, DUMP, EXTRA_FR, FRTRACE, SHAPE_LOGS, SHAPE_DETAIL,
          NAN, NAN_WATCH, DOWNLOADS, DOWNLOADS + " --fix", BANDWIDTH}

# Stand-ins on PATH: ssh runs the command here as host $1 ("down" is unreachable); nvidia-smi reports 4 GPUs,
# with GPU 2 of node-b idle and hot; scontrol expands any node list to localhost,node2.
FAKES = {
    "ssh": """while [ "$1" = -o ]; do shift 2; done
host=$1; shift
[ "$host" = down ] && { echo "ssh: connect to host down port 22: Connection timed out" >&2; exit 255; }
FAKE_HOST=$host exec bash -c "$*"
""",
    "nvidia-smi": """for i in 0 1 2 3; do
  if [ "$FAKE_HOST" = node-b ] && [ $i = 2 ]; then echo "$i, 0, 1024, 81559, 90.5, 87"
  else echo "$i, 97, 70000, 81559, 650.25, 66"; fi
done
""",
    "scontrol": """[ "$1 $2" = "show hostnames" ] && printf 'localhost\\nnode2\\n'
""",
}


class Job:
    """A shell command in a session of its own, its output in a file under the scratch folder."""

    def __init__(self, command, env, cwd):
        self.command, self.started = command, time.time()
        # NOTE: conftest looks for TEST_PROCESS_MARKER=<marker> as a substring, so it still sees this job's
        # processes; the suffix lets stop() end this job's processes without touching the test's other jobs.
        self.marker = f"{env['TEST_PROCESS_MARKER']}-{uuid.uuid4().hex[:8]}"
        fd, self.log = tempfile.mkstemp(dir=cwd, suffix=".log")
        with os.fdopen(fd, "w") as out:
            self.process = subprocess.Popen(["bash", "-c", command], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                            env={**env, "TEST_PROCESS_MARKER": self.marker}, start_new_session=True)

    def wait(self, timeout):
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s: {self.command}\n{self.output[-3000:]}")
        finally:
            self.stop()
        self.seconds = time.time() - self.started
        return self

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # torchrun forwards it to its workers
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        for pid in processes_with_marker(self.marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    @property
    def returncode(self):
        return self.process.returncode

    @property
    def output(self):
        return Path(self.log).read_text(errors="replace")


def run(command, env, cwd, timeout=180):
    return Job(command, env, cwd).wait(timeout)


def start_seconds(env, cwd):
    """The seconds a process that imports torch.distributed takes here now, start to end: the unit of this file's
    time bounds (on a shared 2-core machine it is several times a laptop's)."""
    return run(f"{sys.executable} -c 'import torch.distributed'", env, cwd).seconds


@pytest.fixture
def cold_env(env):
    """The conftest environment, but every process starts cold: the hang dumps find a job's ranks in torchrun's
    process tree and dump their stacks, which processes forked by the suite's warm start are not."""
    return cold_start(env)


@pytest.fixture
def scratch(tmp_path, env):
    """tmp_path as the repository root for the README's commands, with the fakes in fakes/ (see with_fakes)."""
    (tmp_path / "diagnosing-errors").symlink_to(CHAPTER)
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    for name, body in FAKES.items():
        (fakes / name).write_text("#!/bin/bash\n" + body)
        (fakes / name).chmod(0o755)
    env.update(TMPDIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]]))
    return tmp_path


def with_fakes(env, cwd):
    """env with the fake ssh, nvidia-smi and scontrol first on PATH."""
    return {**env, "PATH": os.pathsep.join([str(cwd / "fakes"), env["PATH"]])}


def line_of(script, text):
    """The number of the one line of diagnosing-errors/<script> whose code starts with text."""
    lines = [n for n, line in enumerate((CHAPTER / script).read_text().splitlines(), 1) if line.strip().startswith(text)]
    assert len(lines) == 1, (script, text, lines)
    return lines[0]


def waits_at(script, code, function):
    """What dump_hang prints for ranks waiting at the line of broken/<script> that starts with code."""
    return f"waits at diagnosing-errors/broken/{script}:{line_of('broken/' + script, code)} in {function}"


def job_section(output, script):
    """The part of dump_hang's output about the job running `script` (other jobs may run on this host)."""
    return next((part for part in ("\n" + output).split("\n== ") if f"broken/{script}" in part), "")


def wait_for_hang(command, env, cwd, script, first, second, timeout=150):
    """Run dump_hang until the job shows `first` (the odd rank's "waits at") and then `second`, and no rank anywhere
    else (a rank still starting up on a busy machine is not part of the hang yet); return that part."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        section = job_section(run(command, env, cwd, timeout=60).output, script)
        waits = re.findall(r"waits at \S+:\d+ in \w+", section)
        if first in section and second in section.split(first, 1)[1] and set(waits) <= {first, second}:
            return section
        time.sleep(1)
    raise AssertionError(f"no hang like {first!r} within {timeout} s; last dump:\n{section}")


def test_readme_bash_blocks_are_the_tested_commands():
    readme = (CHAPTER / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = {line.strip() for block in blocks for line in block.splitlines() if line.strip()}
    assert commands == TESTED
    # the sample dump_hang output quotes lines of code by number: they must still be those lines
    for script, line, code in re.findall(r"waits at diagnosing-errors/(broken/\w+\.py):(\d+) in \w+: (.*)", readme):
        source = (CHAPTER / script).read_text().splitlines()[int(line) - 1].strip()
        assert source.startswith(code.removesuffix("...").strip()), (script, line, code)


def test_preflight_passes_on_a_healthy_two_process_job(scratch, env):
    job = run(PREFLIGHT, env, scratch)
    assert job.returncode == 0, job.output
    assert len(re.findall(r"^preflight: \S+  ranks 0-1  2x cpu  torch ", job.output, re.M)) == 1, job.output
    assert "PREFLIGHT OK: 2 rank(s) on 1 host(s), gloo; all-reduce of 4 MB correct" in job.output


def test_collective_bandwidth_prints_nccl_tests_bus_bandwidth_for_every_collective(scratch, env):
    """The README's command, then --json on 4 ranks: every collective at 1, 2, 4 and 8 KB; algorithm bandwidth is
    bytes / time, bus bandwidth nccl-tests' factor of it (all_reduce 2(n-1)/n = 3/2, the gathers and all_to_all
    (n-1)/n = 3/4, send/recv 1)."""
    job = run(BANDWIDTH, env, scratch)
    assert job.returncode == 0 and re.search(r"^all_to_all +8,192 ", job.output, re.M), job.output
    job = run(BANDWIDTH.replace("--nproc-per-node 2", "--nproc-per-node 4") + " --json --ops all_reduce all_gather "
              "reduce_scatter all_to_all send_recv", env, scratch)
    assert job.returncode == 0, job.output
    rows = json.loads(job.output[job.output.index("[\n"):job.output.rindex("]") + 1])
    factors = {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "send_recv": 1.0}
    assert [(row["op"], row["bytes"]) for row in rows] == [(op, size) for op in factors for size in (1024, 2048, 4096,
                                                                                                    8192)]
    for row in rows:
        assert row["algbw_gbps"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9), row
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factors[row["op"]]), row


def test_preflight_fails_clearly_when_a_rank_cannot_join(scratch, env):
    # The README's command on a free port, in case another job here holds 29555.
    port = free_port()
    job = run(PREFLIGHT_ALONE.replace("MASTER_PORT=29555", f"MASTER_PORT={port}"), env, scratch, timeout=90)
    assert job.returncode == 1, job.output
    assert "PREFLIGHT FAILED (rank 0 on" in job.output
    assert f"could not form the group of 2 ranks at localhost:{port} within 5 s" in job.output
    assert "1/2 clients joined" in job.output
    start = start_seconds(env, scratch)
    print(f"\npreflight alone failed after {job.seconds:.1f}s (--timeout 5; a start here: {start:.1f}s)")
    assert job.seconds < 5 + 4 * start


def test_preflight_under_slurm_without_torchrun(scratch, env):
    # srun starts one process per task with SLURM_* set; MASTER_ADDR comes from scontrol (a fake here).
    port = free_port()
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "localhost,node2",
             "SLURM_JOB_ID": "77", "MASTER_PORT": str(port)}
    jobs = [Job("python diagnosing-errors/tools/preflight.py --timeout 60", {
        **with_fakes(env, scratch), **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}, scratch)
        for rank in (0, 1)]
    try:
        rank0, rank1 = [job.wait(120) for job in jobs]
    finally:
        for job in jobs:
            job.stop()
    assert rank0.returncode == 0 and rank1.returncode == 0, rank0.output + rank1.output
    assert "PREFLIGHT OK: 2 rank(s) on 1 host(s)" in rank0.output


def test_extra_allreduce_hang_dump_names_the_odd_ranks_line(scratch, cold_env):
    script = "extra_allreduce.py"
    odd, rest = waits_at(script, "dist.all_reduce(p.grad)", "train"), waits_at(script, "dist.barrier()", "main")
    job = Job(EXTRA, cold_env, scratch)
    try:
        section = wait_for_hang(DUMP, cold_env, scratch, script, odd, rest)
        groups = section.split("\n-- ")[1:]
        assert groups[0].startswith("rank 0 (") and "odd one out" in groups[0].splitlines()[0], section
        assert groups[1].startswith("ranks 1-2 ("), section
        # the same, given torchrun's process id
        by_pid = job_section(run(f"{DUMP} {job.process.pid}", cold_env, scratch, timeout=60).output, script)
        assert odd in by_pid.split("\n-- ")[1]
    finally:
        job.stop()


def test_rank_conditional_hang_dump_shows_why_also_over_ssh(scratch, cold_env):
    script = "rank_conditional.py"
    odd = waits_at(script, "dist.barrier()", "save_checkpoint")
    rest = waits_at(script, "dist.all_reduce(p.grad)", "train")
    job = Job(CONDITIONAL, cold_env, scratch)
    try:
        section = wait_for_hang(DUMP, cold_env, scratch, script, odd, rest)
        rank0 = section.split("\n-- ")[1]
        assert rank0.startswith("rank 0 (") and "odd one out" in rank0, section
        assert f"train (diagnosing-errors/broken/{script}:" in rank0  # who called save_checkpoint
        (scratch / "hosts").write_text("node-b  # through the fake ssh\n")
        remote = run(f"{DUMP} --hosts hosts", with_fakes(cold_env, scratch), scratch, timeout=90)
        assert odd in job_section(remote.output, script).split("\n-- ")[1], remote.output
    finally:
        job.stop()


def test_timeout_fires_and_the_flight_recorder_names_the_culprit(scratch, env):
    job = run(EXTRA_FR, env, scratch)
    assert job.returncode != 0
    start = start_seconds(env, scratch)
    print(f"\nextra all-reduce under the flight recorder failed after {job.seconds:.1f}s (--timeout 5; a start "
          f"here: {start:.1f}s)")
    assert job.seconds < 5 + 10 * start
    assert "Timed out waiting 5000ms" in job.output
    # @record puts each rank's traceback into torchrun's summary, down to the waiting line
    line = line_of("broken/extra_allreduce.py", "dist.all_reduce(p.grad)")
    assert f'extra_allreduce.py", line {line}, in train' in job.output.split("Failures:")[-1]
    assert sorted(p.name for p in (scratch / "outputs" / "fr").iterdir()) == ["rank_0", "rank_1", "rank_2"]
    trace = run(FRTRACE, env, scratch, timeout=60)
    assert trace.returncode == 0, trace.output
    assert "Culprit rank 0; Error type: COLLECTIVE_TYPE_MISMATCH" in trace.output, trace.output


def test_shape_mismatch_crashes_one_rank_and_each_rank_has_its_log(scratch, env):
    job = run(SHAPE_LOGS, env, scratch)
    assert job.returncode != 0
    assert "Is there a distributed collective mismatch in your code?" in job.output
    logs = sorted((scratch / "outputs" / "logs").glob("*/attempt_0/*/stderr.log"))
    assert [log.parent.name for log in logs] == ["0", "1"]
    assert any("gloo::EnforceNotMet" in log.read_text() for log in logs)


def test_detail_debug_reports_the_shape_mismatch(scratch, env):
    job = run(SHAPE_DETAIL, env, scratch)
    assert job.returncode != 0
    assert "Detected mismatch between collectives on ranks" in job.output
    assert "TensorShape=[5]" in job.output and "TensorShape=[4]" in job.output


def test_nan_watch_names_the_first_bad_step_rank_and_module(scratch, env):
    plain = run(NAN, env, scratch)
    assert plain.returncode == 0, plain.output
    assert re.search(r"^step 35 loss \d", plain.output, re.M) and "step 40 loss nan" in plain.output
    watched = run(NAN_WATCH, env, scratch)
    assert watched.returncode != 0
    assert "nan_watch: rank 1, step 37: first non-finite value is the output of MSELoss" in watched.output


def test_everyone_downloads_and_the_fix_downloads_once(scratch, env):
    for command, misses in ((DOWNLOADS, 2), (DOWNLOADS + " --fix", 1)):
        job = run(command, env, scratch)
        assert job.returncode == 0, job.output
        assert job.output.count("cache miss, downloaded and tokenized") == misses, job.output
        assert job.output.count("300000 tokens ready") == 2


def test_the_fixes_fix(scratch, env):
    commands = [EXTRA + " --fix --timeout 30", CONDITIONAL + " --fix --timeout 30",
                "torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/shape_mismatch.py --fix"]
    jobs = [Job(command, env, scratch) for command in commands]  # at once: they are small
    try:
        for job in jobs:
            job.wait(180)
            assert job.returncode == 0, job.output
    finally:
        for job in jobs:
            job.stop()
    assert "global label counts [2, 3, 3, 3, 1]" in jobs[2].output


def test_cluster_top_flags_the_idle_and_hot_gpu_and_the_unreachable_host(scratch, env):
    (scratch / "hosts").write_text("localhost\nnode-b  # second node\n\ndown\n")
    job = run("python diagnosing-errors/tools/cluster_top.py hosts --once", with_fakes(env, scratch), scratch, 60)
    assert job.returncode == 0, job.output
    rows = {line.split()[0]: line for line in job.output.splitlines()[2:]}
    assert rows["localhost"].split()[1:5] == ["97", "97", "97", "97"] and "idle" not in rows["localhost"]
    assert "gpu2 idle, gpu2 87C" in rows["node-b"]
    assert "unreachable: ssh: connect to host down port 22: Connection timed out" in rows["down"]
    assert "3 hosts, 8 GPUs, mean utilization 85%" in job.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine these programs really run")
def test_gpu_programs_refuse_cleanly_without_a_gpu(scratch, env):
    jobs = {name: Job(f"python diagnosing-errors/broken/{name}.py", env, scratch)
            for name in ("oom_step2", "missing_set_device")}
    for name, job in jobs.items():
        job.wait(60)
        assert job.returncode == 1
        assert job.output.strip().startswith(f"{name}.py needs ")
