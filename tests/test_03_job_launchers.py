"""Chapter 03: every launcher starts the same training, and it trains exactly as chapter 02 does under torchrun:
Slurm with one torchrun per node (job.sbatch), Slurm with srun alone (job-srun.sbatch), Open MPI (mpirun.sh), and
two torchrun agents acting as two nodes. An elastic restart after a rank is killed resumes from the last checkpoint
and ends with the weights of an uninterrupted run; a rendezvous endpoint nobody listens on fails with a message
that names it, in bounded time, instead of hanging. The Kubernetes manifests validate against the API's schemas,
and their pods, run here as local processes, stop on SIGTERM with exit 75, resume and train as chapter 02 does.

The Slurm and MPI tests need a cluster. `eval "$(.ci/launchers.sh up /tmp/slurm-state)"` starts a two-node one on
this machine (root, Debian); without one they are skipped, or fail when the variable CI is set. Network tests only
ever use 127.0.0.1. `pytest -s` prints the figures. The training processes start warm (tests/warm_start), on the CPUs
the launcher bound them to; the elastic restart's and the CPU probes' start cold (the launcher_env fixture below).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from helpers import (CHAPTERS, FAST_ARGS, GRAD_NORM_TOLERANCE, NO_CLIPPING, REPO, SLOWDOWN, check_family_matrix,
                     cold_start, error_line, free_port, grad_norm_difference, loss_and_weight_differences,
                     read_losses, run, run_together, script, with_faults)

CHAPTER = REPO / CHAPTERS["03"]
FAULTS = REPO / "tests" / "faults"
# 6 steps on 2 ranks of 4 sequences each, a checkpoint every 2 steps (the fault test resumes from one); no wandb.
STEPS = 6
ARGS = ["--max-steps", str(STEPS), "--ckpt-freq", "2", "--wandb-mode", "disabled"]
FINAL_CHECKPOINT = f"checkpoint-{STEPS:08d}"
# Seconds a whole launch may take: startup (imports) dominates, and a loaded 2-core machine is slow.
LAUNCH_TIMEOUT = 600
START_THE_CLUSTER = 'start the local test cluster first: eval "$(.ci/launchers.sh up /tmp/slurm-state)"'


def reference_run(runs, env, *clipping):
    """Chapter 02 under torchrun --standalone with 2 processes: what every launcher must reproduce."""
    return runs.train("02", env, *ARGS, *clipping, nproc=2)


def unavailable(reason):
    """Skip a test whose launcher is missing; under CI (variable CI set) fail instead, so nothing skips silently."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: failing instead of skipping); {START_THE_CLUSTER}")
    pytest.skip(f"{reason}; {START_THE_CLUSTER}")


@pytest.fixture
def launcher_env(env):
    """The conftest environment, but every process starts cold: each rank of the elastic restart needs its own
    string-hash seed, which a fork shares, and the CPU probes report what the launcher gave the process itself."""
    return cold_start(env)


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None:
        unavailable("sbatch is not installed")
    nodes = subprocess.run(["sinfo", "-h", "-N", "-t", "idle,mixed,allocated", "-o", "%N"], capture_output=True,
                           text=True, timeout=60)
    if nodes.returncode != 0 or len(set(nodes.stdout.split())) < 2:
        said = (nodes.stderr or nodes.stdout).strip().splitlines()
        unavailable(f"no Slurm cluster with 2 nodes up answers sinfo ({said[-1] if said else 'no nodes'})")


@pytest.fixture(scope="module")
def mpirun():
    if shutil.which("mpirun") is None:
        unavailable("mpirun (Open MPI) is not installed")


@pytest.fixture
def repo_lookalike(tmp_path):
    """A scratch folder that looks like the repository root to the launch files: commands run there as the README
    writes them (03-job-launchers/job.sbatch ...), and their outputs and logs land there, not in the repository."""
    (tmp_path / CHAPTERS["03"]).symlink_to(CHAPTER)
    return tmp_path


def train_args(workdir, experiment):
    return [*FAST_ARGS, "--save-dir", workdir / "outputs", "-e", experiment, *ARGS]


def sbatch(options, job_file, env, workdir, *args):
    """`sbatch --wait OPTIONS 03-job-launchers/JOB_FILE ARGS` from workdir; returns the job's output file, as text.

    The job gets a unique name and is cancelled whatever happens, so it never outlives the test.
    """
    name = f"test-{uuid.uuid4().hex[:8]}"
    command = ["sbatch", "--wait", "--job-name", name, "--time", "15", *options, f"{CHAPTERS['03']}/{job_file}", *args]
    try:
        result = run(command, env, workdir, timeout=LAUNCH_TIMEOUT, check=False)
    finally:
        cancel_job(name, env)
    outputs = sorted(workdir.glob(f"{name}-*.out"))
    assert len(outputs) == 1, f"no output file {name}-<job id>.out in {workdir}: {result.stderr}"
    output = outputs[0].read_text()
    assert result.returncode == 0, f"sbatch exit {result.returncode}: {result.stderr}\n--- job output\n{output[-6000:]}"
    return output


def cancel_job(name, env):
    subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "--name", name], env=env, capture_output=True, text=True, timeout=60)
        if queued.returncode == 0 and not queued.stdout.strip():
            return
        time.sleep(1)


def torchrun_agent(port, rdzv_id, *torchrun_args):
    """One torchrun agent of a two-"node" job on this machine: one worker, c10d rendezvous at 127.0.0.1:port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
            "--local-addr", "127.0.0.1", *torchrun_args]


def assert_matches_reference(runs, env, experiment, what, clipping=()):
    _, reference = reference_run(runs, env, *clipping)
    assert len(read_losses(experiment)) == STEPS
    loss_difference, weight_difference = loss_and_weight_differences(reference, experiment, FINAL_CHECKPOINT)
    norm_difference = grad_norm_difference(reference, experiment, clipped=not clipping)
    print(f"\n{what} vs chapter 02 (torchrun, 2 processes): largest loss difference {loss_difference:.1e}, "
          f"largest weight difference {weight_difference:.1e}, relative gradient norm difference "
          f"{norm_difference:.1e} after {STEPS} steps")
    assert loss_difference <= 1e-5
    assert weight_difference <= 1e-5
    assert norm_difference <= GRAD_NORM_TOLERANCE


# NOTE: long: a real 2-node Slurm job, whose sbatch, srun and slurmstepd start and stop the job's steps.
def test_slurm_with_torchrun_on_two_nodes_matches_chapter_02(env, runs, slurm, repo_lookalike):
    output = sbatch(["--nodes", "2"], "job.sbatch", env, repo_lookalike, *train_args(repo_lookalike, "slurm-torchrun"))
    assert "nodes=n[1-2] nproc/node=1" in output
    assert "started by torchrun" in output and "rank 1 of 2" in output
    # --label: both nodes' torchrun print into the one output file, each line prefixed with its node's number.
    assert re.search(r"^0: ", output, re.MULTILINE) and re.search(r"^1: ", output, re.MULTILINE)
    assert len(list((repo_lookalike / "logs").glob("test-*/n[12]/*/attempt_0/0/stdout.log"))) == 2
    assert_matches_reference(runs, env, repo_lookalike / "outputs" / "slurm-torchrun", "Slurm + torchrun")


# NOTE: long: a real 2-node Slurm job, whose sbatch, srun and slurmstepd start and stop the job's steps.
def test_slurm_with_srun_alone_matches_chapter_02(env, runs, slurm, repo_lookalike):
    output = sbatch(["--nodes", "2", "--ntasks-per-node", "1"], "job-srun.sbatch", env, repo_lookalike,
                    *train_args(repo_lookalike, "slurm-srun"))
    assert "started by srun" in output and "rank 1 of 2" in output
    assert_matches_reference(runs, env, repo_lookalike / "outputs" / "slurm-srun", "Slurm + srun")


def test_mpirun_matches_chapter_02(env, runs, mpirun, repo_lookalike):
    mpirun_env = {**env, "MASTER_PORT": str(free_port())}
    if os.geteuid() == 0:
        mpirun_env["MPIRUN_ARGS"] = "--allow-run-as-root"   # Open MPI refuses root without it (CI runs as root)
    # The hosts file next to the script: "localhost slots=2".
    result = run([f"{CHAPTERS['03']}/mpirun.sh", *train_args(repo_lookalike, "mpirun")], mpirun_env, repo_lookalike,
                 timeout=LAUNCH_TIMEOUT)
    assert "started by mpirun" in result.stdout and "rank 1 of 2" in result.stdout
    assert_matches_reference(runs, env, repo_lookalike / "outputs" / "mpirun", "mpirun")


# Clipping at 1.0 binds at every step of every launcher's run, and at none with NO_CLIPPING.
@pytest.mark.parametrize("clipping", [pytest.param([], marks=pytest.mark.quick), NO_CLIPPING], ids=["clipped", "unclipped"])
def test_two_torchrun_agents_act_as_two_nodes_and_match_chapter_02(env, runs, tmp_path, clipping):
    port = free_port()
    agent = [*torchrun_agent(port, "two-nodes"), script("03"), *train_args(tmp_path, "two-agents"), *clipping]
    results = run_together([agent, agent], env, tmp_path, timeout=LAUNCH_TIMEOUT)
    for result in results:
        assert result.returncode == 0, result.stderr[-5000:]
    output = "".join(result.stdout for result in results)
    assert "rank 0 of 2 (local rank 0)" in output and "rank 1 of 2 (local rank 0)" in output
    assert_matches_reference(runs, env, tmp_path / "outputs" / "two-agents", "two torchrun agents", clipping)


# NOTE: long: two cold agents, a killed rank, torchrun's restart of both ranks (cold again) and the resumed run.
def test_a_killed_rank_is_restarted_resumes_and_ends_as_an_uninterrupted_run(env, launcher_env, runs, tmp_path):
    once_file = tmp_path / "killed-once"
    fault_env = {
        **launcher_env,
        # torchrun's restarts hang or fail in torch 2.13 when the workers share the agent's rendezvous TCP store
        # (pytorch issues #135712, #167288); every launch file of the chapter sets this too.
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # SIGKILL rank 1 right after its 3rd optimizer step, once: the checkpoint of step 2 exists by then.
        "PYTHONPATH": str(FAULTS),
        "FAULT_KILL_AFTER_STEPS": "3",
        "FAULT_RANK": "1",
        "FAULT_ONCE_FILE": str(once_file),
    }
    agent = [*torchrun_agent(free_port(), "restart", "--max-restarts", "1"), script("03"),
             *train_args(tmp_path, "restarted")]
    started = time.monotonic()
    results = run_together([agent, agent], fault_env, tmp_path, timeout=LAUNCH_TIMEOUT + 120)
    seconds = time.monotonic() - started
    for result in results:
        assert result.returncode == 0, result.stderr[-5000:]
    assert once_file.exists(), "the fault was never injected"
    output = "".join(result.stdout + result.stderr for result in results)
    assert "exitcode: -9" in output
    resumed = re.findall(r"^(\d\d:\d\d:\d\d) \[rank (\d)\] INFO resumed from \S+/checkpoint-00000002 at step 2$",
                         output, re.MULTILINE)
    assert sorted(rank for _, rank in resumed) == ["0", "1"], output[-5000:]
    killed = re.search(r"^E\d{4} (\d\d:\d\d:\d\d)\.\d+ .* failed \(exitcode: -9\)", output, re.MULTILINE)
    print(f"\nrestart: rank 1 killed after step 3 at {killed.group(1) if killed else '?'}, both ranks resumed from "
          f"step 2 at {resumed[0][0]}; the whole job took {seconds:.0f}s")
    assert_matches_reference(runs, env, tmp_path / "outputs" / "restarted", "killed, restarted and resumed")


# What a training process of a Slurm job is given: its CPUs (the task's share, and those it may run on).
CPU_PROBE = """import os
print(f"cpus of rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID'))}: "
      f"SLURM_CPUS_PER_TASK={os.environ.get('SLURM_CPUS_PER_TASK')} affinity={len(os.sched_getaffinity(0))}")
"""


def active_directives(job_file):
    """The #SBATCH lines sbatch reads (a doubled ## disables one), without the prefix."""
    return [line.split(None, 1)[1] for line in (CHAPTER / job_file).read_text().splitlines()
            if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("job_file", ["job.sbatch", "job-srun.sbatch"])
def test_the_slurm_jobs_ask_for_the_nodes_cpus_and_memory(job_file):
    directives = active_directives(job_file)
    assert "--exclusive" in directives and "--mem=0" in directives, directives
    srun_lines = [line for line in (CHAPTER / job_file).read_text().splitlines() if line.startswith("srun ")]
    assert len(srun_lines) == 1 and '--cpus-per-task "$CPUS_PER_TASK"' in srun_lines[0], srun_lines


def node_cpus():
    cpus = subprocess.run(["sinfo", "-h", "-N", "-o", "%c"], capture_output=True, text=True, timeout=60).stdout.split()
    assert len(set(cpus)) == 1, f"nodes with different CPU counts: {cpus}"
    return int(cpus[0])


# (job file, sbatch options, processes, processes per node)
CPU_LAYOUTS = {
    "torchrun-2-nodes": ("job.sbatch", ["--nodes", "2"], 2, 1),
    "srun-2-nodes": ("job-srun.sbatch", ["--nodes", "2", "--ntasks-per-node", "1"], 2, 1),
    "srun-2-tasks-on-1-node": ("job-srun.sbatch", ["--nodes", "1", "--ntasks-per-node", "2"], 2, 2),
}


@pytest.mark.parametrize("layout", CPU_LAYOUTS)
def test_every_process_of_a_slurm_job_gets_its_share_of_the_nodes_cpus(launcher_env, slurm, repo_lookalike, layout):
    job_file, options, processes, per_node = CPU_LAYOUTS[layout]
    (repo_lookalike / "cpu_probe.py").write_text(CPU_PROBE)
    output = sbatch(options, job_file, {**launcher_env, "TRAIN_SCRIPT": "cpu_probe.py"}, repo_lookalike)
    share = node_cpus() // per_node
    reports = re.findall(r"cpus of rank (\d+): SLURM_CPUS_PER_TASK=(\S+) affinity=(\d+)$", output, re.MULTILINE)
    print(f"\n{layout}: {node_cpus()} CPUs per node, {per_node} process(es) per node: "
          f"{', '.join(f'rank {rank} SLURM_CPUS_PER_TASK={cpus} affinity={affinity}' for rank, cpus, affinity in reports)}")
    assert f"cpus/task={share}" in output
    assert sorted(rank for rank, _, _ in reports) == [str(rank) for rank in range(processes)], output[-3000:]
    for _, cpus, affinity in reports:
        assert cpus == str(share) and int(affinity) >= share


def test_mpirun_forwards_the_variables_training_reads(launcher_env, tmp_path):
    # An mpirun that prints its arguments: what the real one would be asked to do.
    fake = tmp_path / "bin" / "mpirun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$*"\n')
    fake.chmod(0o755)
    settings = {"HF_HOME": "/shared/hf", "HF_TOKEN": "hf_secret", "NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5",
                "WANDB_API_KEY": "secret", "WANDB_PROJECT": "llm", "MY_SETTING": "1", "UNRELATED": "1"}
    mpirun_env = {**launcher_env, **settings, "FORWARD_ENV": "MY_SETTING", "PATH": f"{fake.parent}:{launcher_env['PATH']}"}
    result = run([CHAPTER / "mpirun.sh", "-e", "forwarding"], mpirun_env, tmp_path)
    forwarded = re.findall(r"-x (\S+)", result.stdout)
    print(f"\nmpirun.sh forwards: {' '.join(forwarded)}")
    for name in ["MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "PYTORCH_ALLOC_CONF", "PATH", "HF_HOME",
                 "HF_TOKEN", "NCCL_DEBUG", "NCCL_IB_HCA", "WANDB_API_KEY", "WANDB_PROJECT", "MY_SETTING"]:
        assert name in forwarded, (name, result.stdout)
    assert "UNRELATED" not in forwarded and len(forwarded) == len(set(forwarded))
    assert "hf_secret" not in result.stdout + result.stderr, "values travel in the environment, not on the command line"


def test_launch_ssh_forwards_the_same_variables(env, tmp_path):
    # An ssh that prints the command tmux would run on the host.
    fake = tmp_path / "ssh"
    fake.write_text('#!/bin/bash\nhost=$1; shift\n'
                    'tmux() { if [ "$1" = has-session ]; then return 1; fi; echo "$host: ${*: -1}"; }\neval "$*"\n')
    fake.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("node-a slots=1\n")
    settings = {"HF_HOME": "/shared/hf", "NCCL_IB_HCA": "mlx5", "WANDB_PROJECT": "llm", "UNRELATED": "1"}
    result = run([CHAPTER / "launch-ssh.sh", hosts, "-e", "forwarding"], {**env, **settings, "SSH": str(fake)},
                 tmp_path)
    for assignment in ["HF_HOME=/shared/hf", "NCCL_IB_HCA=mlx5", "WANDB_PROJECT=llm",
                       "PYTORCH_ALLOC_CONF=expandable_segments:True"]:
        assert f" {assignment} " in result.stdout, result.stdout
    assert "UNRELATED" not in result.stdout
    # A setting of the user's own wins over the launcher's default, under either name (torch warns at the older one).
    for name in ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]:
        result = run([CHAPTER / "launch-ssh.sh", hosts, "-e", "forwarding"],
                     {**env, "SSH": str(fake), name: "max_split_size_mb:512"}, tmp_path)
        assert " PYTORCH_ALLOC_CONF=max_split_size_mb:512 " in result.stdout, result.stdout


@pytest.fixture
def closed_port():
    """A port on 127.0.0.1 that refuses connections: bound by this test and never listened on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_srun_or_mpirun_rank_with_an_unreachable_endpoint_fails_in_bounded_time(env, tmp_path, closed_port):
    # What srun sets for the second of two tasks; the job script's MASTER_ADDR:MASTER_PORT point at nothing.
    rank_env = {**env, "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(closed_port)}
    started = time.monotonic()
    result = run([sys.executable, script("03"), "--rdzv-timeout", "5", "--save-dir", tmp_path / "outputs"],
                 rank_env, tmp_path, timeout=180, check=False)
    seconds = time.monotonic() - started
    print(f"\nsrun-style rank 1, closed port: exit {result.returncode} after {seconds:.0f}s "
          f"(imports included): {error_line(result)}")
    assert result.returncode == 1
    assert error_line(result).startswith(f"error: rank 1 on {socket.gethostname()} cannot reach "
                                         f"127.0.0.1:{closed_port} in 5s"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr


def test_python_in_a_slurm_batch_script_is_one_process(env, tmp_path):
    # What a batch script's own shell holds (sbatch --ntasks 4): SLURM_PROCID too, but no step of srun's tasks.
    batch_env = {**env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "7"}
    result = run([sys.executable, script("03"), *FAST_ARGS, "--max-steps", "1", "--save-dir", tmp_path / "outputs"],
                 batch_env, tmp_path, timeout=300)
    assert "started by python (one process)" in result.stdout and "rank 0 of 1 " in result.stdout, result.stdout


def test_torchrun_agent_with_an_unreachable_endpoint_fails_in_bounded_time(env, tmp_path, closed_port):
    # A node that does not host the rendezvous (is_host=false) gives up connecting after read_timeout seconds.
    agent = [*torchrun_agent(closed_port, "unreachable", "--rdzv-conf", "is_host=false,read_timeout=10"),
             script("03"), *train_args(tmp_path, "unreachable")]
    started = time.monotonic()
    result = run(agent, env, tmp_path, timeout=180, check=False)
    seconds = time.monotonic() - started
    message = re.search(r"^\S*DistNetworkError: (.*)$", result.stderr, re.MULTILINE)
    print(f"\ntorchrun agent, closed port: exit {result.returncode} after {seconds:.0f}s: {error_line(result)} / "
          f"{message.group(1) if message else '?'}")
    assert result.returncode == 1
    assert error_line(result).startswith("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: "
                                         "The connection to the C10d store has failed")
    assert message and message.group(1) == (f"The client socket has timed out after 10000ms while trying to connect "
                                            f"to (127.0.0.1, {closed_port}).")
    assert not (tmp_path / "outputs").exists(), "no worker should have started"


def test_every_model_family_trains_as_in_chapter_01_or_gets_one_line(runs, env, family_models):
    """The family-by-chapter matrix's column of this chapter (helpers.FAMILIES, FAMILY_REFUSALS)."""
    check_family_matrix("03", runs, env, family_models)


KUBERNETES_VERSIONS = ["1.31.0", "1.37.0"]   # podFailurePolicy is stable from 1.31; the validator's newest
JOBSET_SCHEMA = REPO / "tests" / "schemas" / "jobset.x-k8s.io_v1alpha2.json.gz"


def manifest(name):
    import yaml

    return list(yaml.safe_load_all((CHAPTER / name).read_text()))


def strict(schema):
    """A CRD's schema that rejects unknown fields, as kubectl's strict field validation does."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [strict(value) for value in schema]
    return schema


def kubernetes_errors(document):
    """The validation errors of one object: built-in kinds against the Kubernetes API's OpenAPI schemas
    (kubernetes-validate, strict), a JobSet against its CRD's schema (JOBSET_SCHEMA) and its Jobs as batch/v1 Jobs."""
    import gzip
    import json

    import jsonschema
    import kubernetes_validate

    errors = []
    if document["kind"] == "JobSet":
        schema = strict(json.loads(gzip.decompress(JOBSET_SCHEMA.read_bytes())))
        errors += [error.message for error in jsonschema.Draft4Validator(schema).iter_errors(document)]
        documents = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job["name"]}, **job["template"]}
                     for job in document["spec"]["replicatedJobs"]]
    else:
        documents = [document]
    for version in KUBERNETES_VERSIONS:
        for one in documents:
            try:
                kubernetes_validate.validate(one, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                errors.append(f"{version}: {error.message}")
    return errors


@pytest.mark.quick
@pytest.mark.parametrize("name", ["k8s-job.yaml", "k8s-jobset.yaml"])
def test_the_kubernetes_manifests_validate_against_the_api_schemas(name):
    documents = manifest(name)
    assert [document["kind"] for document in documents] == (["Service", "Job"] if name == "k8s-job.yaml" else
                                                            ["JobSet"])
    for document in documents:
        assert kubernetes_errors(document) == [], document["kind"]
    # The positive control: a misspelled field fails both validators.
    job = documents[-1]["spec"]
    template = job["replicatedJobs"][0]["template"]["spec"] if name == "k8s-jobset.yaml" else job
    template["template"]["spec"]["terminationGracePeriod"] = 300
    assert len(kubernetes_errors(documents[-1])) >= (3 if name == "k8s-jobset.yaml" else 2)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["k8s-job.yaml", "k8s-jobset.yaml"])
def test_the_kubernetes_pods_find_pod_0_keep_a_stopped_run_and_outlast_its_save(name):
    document = manifest(name)[-1]
    job = document["spec"]["replicatedJobs"][0]["template"] if name == "k8s-jobset.yaml" else document
    pod = job["spec"]["template"]["spec"]
    container, = pod["containers"]
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    prefix = f"{document['metadata']['name']}-node-0" if name == "k8s-jobset.yaml" else document["metadata"]["name"]
    assert env["RDZV_HOST"] == f"{prefix}-0.{document['metadata']['name']}"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == int(env["NNODES"])
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == env["NPROC_PER_NODE"]
    # Exit 75 (stopped and saved) and a disruption are a stop: the Job replaces the pod uncounted, or fails the Job
    # for JobSet's rule to restart every pod uncounted.
    action = "FailJob" if name == "k8s-jobset.yaml" else "Ignore"
    assert job["spec"]["podFailurePolicy"]["rules"] == [
        {"action": action, "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": action, "onExitCodes": {"containerName": container["name"], "operator": "In", "values": [75]}}]
    if name == "k8s-jobset.yaml":
        rule, = document["spec"]["failurePolicy"]["rules"]
        assert (rule["action"], rule["onJobFailureReasons"]) == ("RestartJobSetAndIgnoreMaxRestarts",
                                                                 ["PodFailurePolicy"])
        assert document["spec"]["network"]["enableDNSHostnames"] is True
    else:
        service = manifest(name)[0]
        assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"] == {"job-name": document["metadata"]["name"]}
    assert pod["restartPolicy"] == "Never" and pod["terminationGracePeriodSeconds"] >= 60
    assert container["resources"]["requests"] == container["resources"]["limits"]   # Guaranteed QoS
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def pod_command(name, index, port, workdir):
    """Pod `index`'s command and environment from the manifest, as the Job controller would give them on this
    machine: its completion index, pod 0's name resolving to 127.0.0.1, one process per pod, the tiny model."""
    import re

    container, = manifest(name)[-1]["spec"]["template"]["spec"]["containers"]
    values = {variable["name"]: variable.get("value", "test-job-uid") for variable in container["env"]}
    values.update(JOB_COMPLETION_INDEX=str(index), RDZV_HOST="127.0.0.1", RDZV_PORT=str(port), NPROC_PER_NODE="1",
                  MAX_STEPS=str(STEPS), SAVE_DIR=str(workdir / "outputs"), EXPERIMENT="k8s")
    args = [re.sub(r"\$\((\w+)\)", lambda match: values[match.group(1)], arg) for arg in container["args"]]
    tiny = ["-m", REPO / "data" / "tiny-llama", "-d", REPO / "data" / "tiny-shakespeare", *FAST_ARGS, *ARGS[2:]]
    return [workdir / container["command"][0], *args, *tiny], values


def run_together_pods(pods, env, workdir, while_running=None):
    """The pods' commands at once, each with its own environment (run_together's, per command)."""
    return run_together([command for command, _ in pods], [{**env, **values} for _, values in pods], workdir,
                        timeout=LAUNCH_TIMEOUT, while_running=while_running)


# NOTE: steps of 0.5 s at least, so that the stop comes before the last step on a busy machine.
SLOW_STEPS = {"FAULT_SLEEP_ON_CALL": "torch.nn.utils.clip_grad_norm_:0.5:every"}


# NOTE: long: two "pods" of one process, stopped by a SIGTERM to pod 1, then both started again to the end.
def test_two_kubernetes_pods_stop_on_sigterm_exit_75_resume_and_match_chapter_02(env, runs, repo_lookalike):
    port = free_port()
    pods = [pod_command("k8s-job.yaml", index, port, repo_lookalike) for index in range(2)]
    metrics = repo_lookalike / "outputs" / "k8s" / "metrics.jsonl"

    def preempt_pod_1(processes):
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            if time.monotonic() > deadline or any(process.poll() is not None for process in processes):
                return   # the exit codes' assertion below shows the pods' output
            time.sleep(0.1)
        processes[1].send_signal(signal.SIGTERM)   # the pod's first process, as Kubernetes sends it

    started = time.monotonic()
    stopped = run_together_pods(pods, with_faults(env, **SLOW_STEPS), repo_lookalike, while_running=preempt_pod_1)
    seconds = time.monotonic() - started
    assert [result.returncode for result in stopped] == [75, 75], [result.stderr[-3000:] for result in stopped]
    assert "SIGTERM: checkpoint and exit" in stopped[1].stdout
    # The workers were signalled, not torchrun: no agent waited out its exit barrier (300 s) for pod 1's.
    assert not any("exit barrier" in result.stderr or "death signal" in result.stderr for result in stopped)
    assert seconds < 120 * SLOWDOWN, seconds
    # The step the pods stopped at was saved: a later one than --ckpt-freq 2's step 2.
    saved = sorted(path.name for path in metrics.parent.glob("checkpoint-*"))
    assert "checkpoint-00000002" < saved[-1] < FINAL_CHECKPOINT, saved
    resumed = run_together_pods(pods, env, repo_lookalike)
    assert [result.returncode for result in resumed] == [0, 0], [result.stderr[-3000:] for result in resumed]
    assert f"resumed from {metrics.parent / saved[-1]}" in resumed[0].stdout + resumed[0].stderr
    again = run_together_pods(pods, env, repo_lookalike)
    assert [result.returncode for result in again] == [0, 0] and "done already" in again[0].stdout
    print(f"\nKubernetes pods: SIGTERM to pod 1 after step 2; both saved {saved[-1]} and exited 75 ({seconds:.0f} s), "
          "resumed, exit 0")
    assert_matches_reference(runs, env, metrics.parent, "2 Kubernetes pods, stopped and resumed")
