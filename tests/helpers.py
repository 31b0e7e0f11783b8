"""What every test file shares: where the chapters are, how to run them, how to read what they logged.

Every process a test starts runs in a session of its own with a deadline, and the whole session is killed when the
test is done with it, so a hung or crashed distributed job never outlives its test.
"""

import contextlib
import functools
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
    "08": "08-pipeline-parallel",
    "09": "09-context-parallel",
    "10": "10-expert-parallel",
    "11": "11-4d-parallel",
}
TINY_MODEL = REPO / "data" / "tiny-llama"
TINY_CORPUS = REPO / "data" / "tiny-shakespeare"
TINY_CHAT = REPO / "data" / "tiny-chat"
# Chapter 05 trains on the tiny chat set by default: these flags give it chapter 01's data, all of it for training.
PLAIN_TEXT = ["-d", str(TINY_CORPUS), "--eval-fraction", "0"]
FAULTS = REPO / "tests" / "faults"
COUNTING_RUN = REPO / "tests" / "counting_run.py"
MANY_RUNS = REPO / "tests" / "many_runs.py"

# How much slower than the machine that timed the suite this one runs (at least 1; conftest.py, machine_speed.py).
SLOWDOWN = float(os.environ.get("TESTS_SLOWDOWN", "1"))

# The quick start (README.md, 01's README) as written, stopped after the first 60 of its 200 steps.
QUICK_START_STEPS = 60
QUICK_START_FLAGS = ["--exit-after-steps", str(QUICK_START_STEPS)]
# Small and fast: a 10-step run takes a few seconds on one CPU core.
FAST_ARGS = ["--seq-length", "64", "--batch-size", "4", "--log-freq", "1", "--ckpt-freq", "1000",
             "--warmup-steps", "2", "--num-workers", "0"]


def script(chapter):
    return REPO / CHAPTERS[chapter] / "train_llm.py"


def run(command, env, cwd, timeout=300, check=True):
    """Run a command in its own process session; stop everything it started when it ends or overruns."""
    process = subprocess.Popen([str(part) for part in command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = stack_dumps(env, process.stdout)
        stop_everything(process, env)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout}s: {command}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n"
                             f"{stderr[-3000:]}\n--- stacks\n{stacks}")
    finally:
        stop_everything(process, env)
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {command}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-5000:]}")
    return result


# Commands that start with the session, niced (unless nice=0), and run on the cores the tests leave idle (a
# one-process test keeps one of the two busy), for tests that come later to read: name -> (the fixture through which
# tests read it, a function of its output folder that gives the command, its environment, its niceness). Registered by
# a test file at import (in_background), started by conftest.py's `background` fixture when a selected test uses that
# fixture.
BACKGROUND_RUNS = {}


def in_background(name, fixture, command, environment=None, nice=19):
    """A run that starts with the session when a selected test asks for fixture (conftest.py's `background`):
    command(folder) runs in folder, with environment(the session's environment) if given, else warm-started."""
    BACKGROUND_RUNS[name] = (fixture, command, environment, nice)


class BackgroundRun:
    """A command started now, in a process session of its own (niced by `nice`), whose result wait() returns later,
    like run()'s. Its output goes to temporary files: nobody reads a pipe while it runs."""

    def __init__(self, command, env, cwd, nice=0):
        import tempfile

        self.command, self.env, self.cwd = [str(part) for part in command], env, Path(cwd)
        self.stdout, self.stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command, cwd=cwd, env=env, stdout=self.stdout, stderr=self.stderr,
                                        text=True, start_new_session=True, preexec_fn=lambda: be_nice(nice))

    def wait(self, timeout):
        if self.process.poll() is None:
            hurry(self.process.pid)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stacks = stack_dumps(self.env, self.stdout)
            self.stop()
            raise AssertionError(f"timed out after {timeout}s: {self.command}\n{self.output()[1][-3000:]}\n"
                                 f"--- stacks\n{stacks}")
        stdout, stderr = self.output()
        return subprocess.CompletedProcess(self.command, self.process.returncode, stdout, stderr)

    def output(self):
        self.stdout.seek(0)
        self.stderr.seek(0)
        return self.stdout.read(), self.stderr.read()

    def stop(self):
        stop_everything(self.process, self.env)
        self.process.wait()


class SharedBackgroundRun:
    """A BackgroundRun that the workers of a parallel session (pytest-xdist) share through a folder: the first worker
    to claim the folder starts the run and writes its result there; a test on any worker waits for that result."""

    def __init__(self, folder, command, env, cwd, nice=0):
        import threading

        self.folder, self.cwd, self.run = Path(folder), Path(cwd), None
        self.result_file = self.folder / "result.json"
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.folder / "claimed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        self.run = BackgroundRun(command, env, cwd, nice)
        (self.folder / "pid").write_text(str(self.run.process.pid))
        self.watcher = threading.Thread(target=self._write_result, daemon=True)
        self.watcher.start()

    def _write_result(self):
        self.run.process.wait()
        stdout, stderr = self.run.output()
        partial = self.folder / "result.partial"
        partial.write_text(json.dumps([self.run.command, self.run.process.returncode, stdout, stderr]))
        partial.rename(self.result_file)

    def wait(self, timeout):
        import time

        deadline = time.monotonic() + timeout
        while not (self.folder / "pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not self.result_file.exists() and (self.folder / "pid").exists():
            hurry(int((self.folder / "pid").read_text()))
        while not self.result_file.exists():
            if time.monotonic() > deadline:
                if self.run is None:
                    raise AssertionError(f"timed out after {timeout}s: the run of {self.folder}, which another "
                                         f"worker started")
                stacks = stack_dumps(self.run.env, self.run.stdout)
                self.run.stop()
                raise AssertionError(f"timed out after {timeout}s: {self.run.command}\n"
                                     f"{self.run.output()[1][-3000:]}\n--- stacks\n{stacks}")
            time.sleep(0.2)
        return subprocess.CompletedProcess(*json.loads(self.result_file.read_text()))

    def stop(self, others_done):
        """At the end of this worker's session: the run is stopped once it is over or every other worker is done
        (none can read it any more)."""
        import time

        if self.run is not None:
            while self.run.process.poll() is None and not others_done():
                time.sleep(1)
            self.run.stop()
            self.watcher.join(timeout=60)


def be_nice(nice):
    """This process at niceness nice, and its session's scheduling group too: with autogroup scheduling (Linux's
    default on desktops and Debian) the kernel shares the CPUs between sessions first, and a niceness alone counts
    only within its session (a BackgroundRun has a session of its own)."""
    os.nice(nice)
    if nice > 0:
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(nice))
        except OSError:
            pass  # NOTE: a kernel without autogroup scheduling


def hurry(pid):
    """A test waits for the background run pid: it, what it started and the niced processes the warm-start server
    forked (those of background runs) back at the tests' niceness, where this user may raise a priority (root).
    NOTE: on a machine that other jobs share, a niced run would otherwise wait behind them while the test waits."""
    parents, commands = {}, {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                commands[int(proc.name)] = (proc / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                pass
    roots = {pid} | {other for other, command in commands.items() if b"warm_start/server.py" in command}
    for other in parents:
        ancestor = other
        while ancestor not in roots and ancestor in parents and ancestor > 1:
            ancestor = parents[ancestor]
        try:
            if ancestor in roots and os.getpriority(os.PRIO_PROCESS, other) > 0:
                os.setpriority(os.PRIO_PROCESS, other, 0)
                Path(f"/proc/{other}/autogroup").write_text("0")
        except OSError:
            pass


def stop_everything(process, env):
    """SIGTERM first (torchrun then stops its workers), then SIGKILL the session and every process with the marker.

    NOTE: torchrun starts each worker in a session of its own, so killing torchrun's session alone would leave its
    workers running; the test's marker variable, inherited by every descendant, finds them wherever they are.
    """
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    kill_session(process.pid)
    for pid in processes_with_marker(env.get("TEST_PROCESS_MARKER")):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stack_dumps(env, *streams):
    """py-spy's dump (Python and native frames) of each process a test started that is still running: the next hang
    explains itself. The processes are those with the test's marker, and those writing to one of the streams (a
    file object of ours): a warm-started process carries the warm-start server's environment, not the marker."""
    import shutil

    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if py_spy is None:
        return "no stacks: py-spy is not installed (pip install -r requirements-dev.txt)"
    pids = set(processes_with_marker(env.get("TEST_PROCESS_MARKER"))) | processes_writing_to(streams)
    dumps = []
    for pid in sorted(pids):
        try:
            dump = subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=60)
            dumps.append(dump.stdout if dump.returncode == 0 else f"pid {pid}: {dump.stderr.strip().splitlines()[:1]}")
        except subprocess.TimeoutExpired:
            dumps.append(f"pid {pid}: py-spy did not answer in 60 s")
    return "\n".join(dumps)


def processes_writing_to(streams):
    """Process ids whose standard output or error is one of these file objects (the same pipe or file)."""
    targets = {os.readlink(f"/proc/self/fd/{stream.fileno()}") for stream in streams if stream is not None}
    found = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            for fd in ("1", "2"):
                try:
                    if os.readlink(proc / "fd" / fd) in targets:
                        found.add(int(proc.name))
                except OSError:
                    pass
    return found


def kill_session(session_id):
    try:
        os.killpg(session_id, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def processes_with_marker(marker):
    """Process ids whose environment carries this marker: whatever a test started, and their descendants."""
    if not marker:
        return []
    found = []
    needle = f"TEST_PROCESS_MARKER={marker}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "environ").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


def free_port():
    """A TCP port free on this machine now (a rendezvous or store port for a test's job).

    NOTE: 10000-19999, below the kernel's ephemeral ports (bind(0), outgoing connections) and job.sbatch's 20000 on:
    a bind(0) port was taken by another test's gloo socket before the job bound it (CI, pod 0: exit 1). Each xdist
    worker draws from its own slice, in turn, so two tests never race for one.
    """
    import socket

    if int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) < 20_000:
        with socket.socket() as sock:  # ephemeral ports reach below 20000 here: the kernel's choice, racy
            sock.bind(("", 0))
            return sock.getsockname()[1]
    # NOTE: a worker xdist starts in place of a crashed one is gw<count> or later: modulo, it gets a slice still.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % workers
    slice_size = 10_000 // workers
    slice_start = 10_000 + slice_size * worker
    for _ in range(slice_size):
        free_port.turn = (getattr(free_port, "turn", -1) + 1) % slice_size
        with socket.socket() as sock:
            try:
                sock.bind(("", slice_start + free_port.turn))
            except OSError:
                continue
            return slice_start + free_port.turn
    raise RuntimeError(f"no free port in {slice_start}..{slice_start + slice_size - 1}")


def with_faults(env, **variables):
    """env with the faults of tests/faults/sitecustomize.py switched on by these variables.

    NOTE: its folder goes after the warm start's on PYTHONPATH: the warm start's sitecustomize runs the one it hides
    in the process that runs the command, whether that starts warm or cold.
    """
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(FAULTS)])), **variables}


def readme_experiment(command, chapter):
    """The experiment a README command trains: its -e, else the chapter's default, its folder name."""
    return command[command.index("-e") + 1] if "-e" in command else CHAPTERS[chapter]


def without_experiment(command):
    """A README command without its -e NAME: the experiment is no part of the layout."""
    at = command.index("-e") if "-e" in command else len(command)
    return command[:at] + command[at + 2:]


def error_lines(stderr):
    """The one-line `error: ...` messages in stderr, one per rank that printed one. CPython writes a SystemExit's
    message and its newline in two writes, so two ranks' lines on the job's shared stderr can come out as one."""
    return [f"error: {part}" for line in stderr.splitlines() if line.startswith("error: ")
            for part in line.split("error: ")[1:]]


def cold_start(env):
    """env without the warm-start server: every process it starts imports its libraries itself (tests/warm_start)."""
    return {name: value for name, value in env.items() if name != "WARM_START_SOCKET"}


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


def logged_parameter_count(result):
    """The parameter count a run logged ('model: 4.2M parameters, 4 layers'), as the text it logged ("4.2M")."""
    import re

    return re.search(r"INFO model: ([\d.]+M) parameters", result.stdout).group(1)


def max_difference(losses_a, losses_b):
    assert len(losses_a) == len(losses_b), f"{len(losses_a)} vs {len(losses_b)} steps"
    return max(abs(a - b) for a, b in zip(losses_a, losses_b))


def error_line(result):
    """The one line a failed run printed last on stderr."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class SharedRuns:
    """Training runs that several tests compare against: each runs once, when a test first asks for it.

    conftest.py's session-scoped `runs` fixture holds one for the whole test session, so a chapter 01 reference run
    that several test files ask for with the same arguments runs once. A run is keyed by its chapter, process count
    and arguments, and runs with the environment of the test that first asks for it, so its processes are over
    before that test ends.
    """

    def __init__(self, workdir):
        self.workdir = Path(workdir)
        self.results = {}

    def train(self, chapter, env, *args, nproc=None, launcher=None):
        """Like train(): returns (result, experiment directory), from the first call with the same arguments."""
        import pickle
        import shutil
        import zlib

        key = (chapter, nproc, *map(str, args), *map(str, launcher or []))
        if key not in self.results:
            # NOTE: named by its key and started afresh: a run that failed can leave its folder, with a checkpoint,
            # which a run of another key (or of this one, asked again) would otherwise resume from.
            experiment = f"{chapter}-run-{zlib.crc32(repr(key).encode()):08x}"
            saved = self.workdir / f"{experiment}.pickle"
            # NOTE: the workers of a parallel session share workdir: the first to ask runs it, the others wait for it.
            with locked(self.workdir / f"{experiment}.lock"):
                if saved.exists():
                    self.results[key] = pickle.loads(saved.read_bytes())
                else:
                    shutil.rmtree(self.workdir / "outputs" / experiment, ignore_errors=True)
                    self.results[key] = train(chapter, env, self.workdir, *args, nproc=nproc, experiment=experiment,
                                              launcher=launcher)
                    saved.write_bytes(pickle.dumps(self.results[key]))
        return self.results[key]


@contextlib.contextmanager
def locked(path):
    """An exclusive lock on the file path (created if missing), held for the block, across processes."""
    import fcntl

    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def largest_weight_difference(checkpoint_a, checkpoint_b):
    """The largest absolute difference between the weights (model.pt) of two checkpoints of the same model."""
    import torch

    weights_a = torch.load(Path(checkpoint_a) / "model.pt", map_location="cpu", weights_only=True)
    weights_b = torch.load(Path(checkpoint_b) / "model.pt", map_location="cpu", weights_only=True)
    assert weights_a.keys() == weights_b.keys(), f"different tensors: {sorted(weights_a.keys() ^ weights_b.keys())}"
    return max((weights_a[name] - weights_b[name]).abs().max().item() for name in weights_a)


def counted(result):
    """{rank: counts} from the lines 'counts: {...}' of a run started by tests/counting_run.py."""
    import re

    return {int(rank): json.loads(counts) for rank, counts in re.findall(r"\[rank (\d+)\] counts: (\{[^}]*\})",
                                                                           result.stdout)}


def checkpoint_seconds(result):
    """The seconds each checkpoint took, from the lines 'checkpoint of step N took Xs' of rank 0 (or of one process)."""
    import re

    times = re.findall(r"^\S+ (?:\[rank 0\] )?INFO checkpoint of step \d+ took ([\d.]+)s$", result.stdout, re.MULTILINE)
    return [float(seconds) for seconds in times]


def run_together(commands, env, cwd, timeout=300, while_running=None):
    """Start several commands at once (e.g. one torchrun agent per "node") and wait for all of them.

    Each runs in a process session of its own, with its output in a temporary file (a pipe that nobody reads while
    we wait on another process could fill up and block it). Everything they started is stopped (stop_everything)
    when the commands end or the shared deadline passes. Returns one CompletedProcess per command, whatever their
    exit status. env: one for all, or a list of one per command. while_running(processes), if given, runs once
    they have started (to signal one of them, say).
    """
    import tempfile
    import time

    deadline = time.monotonic() + timeout
    files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in commands]
    processes = []
    timed_out = False
    envs, env = (env, env[0]) if isinstance(env, list) else ([env] * len(commands), env)
    try:
        for command, env_of_command, (stdout, stderr) in zip(commands, envs, files):
            processes.append(subprocess.Popen([str(part) for part in command], cwd=cwd, env=env_of_command,
                                              stdout=stdout, stderr=stderr, text=True, start_new_session=True))
        if while_running is not None:
            while_running(processes)
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                stacks = stack_dumps(env, *(stdout for stdout, _ in files))
                break
    finally:
        for process in processes:
            stop_everything(process, env)
        for process in processes:
            process.wait()
    results = []
    for command, process, (stdout, stderr) in zip(commands, processes, files):
        stdout.seek(0)
        stderr.seek(0)
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read()))
        stdout.close()
        stderr.close()
    if timed_out:
        tails = "\n".join(f"--- {result.args}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}" for result in results)
        raise AssertionError(f"timed out after {timeout}s\n{tails}\n--- stacks\n{stacks}")
    return results


def load_script(chapter):
    """A chapter's train_llm.py imported as a module (its main() does not run), to test one of its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"train_llm_{chapter}", script(chapter))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def planned_layouts(model, *args):
    """tools/plan_layout.py's layouts for data/configs/MODEL, best first (its --json list, run in this process once
    per arguments)."""
    return json.loads(planned_layouts_json(model, *args))


@functools.lru_cache
def planned_layouts_json(model, *args):
    import io

    sys.path.insert(0, str(REPO / "tools"))
    import plan_layout

    argv = sys.argv
    sys.argv = ["plan_layout.py", "-m", str(REPO / "data" / "configs" / model), *args, "--json", "--top", "100"]
    try:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            plan_layout.main()
    finally:
        sys.argv = argv
    return printed.getvalue()


def command_words(command):
    """(the chapter, its train_llm.py, its flags) of a torchrun or sbatch command."""
    import shlex

    words = shlex.split(command)
    if words[0].startswith("TRAIN_SCRIPT="):
        script, flags = words[0].split("=", 1)[1], words[words.index("03-job-launchers/job.sbatch") + 1:]
    else:
        script = next(word for word in words if word.endswith("/train_llm.py"))
        flags = words[words.index(script) + 1:]
    return script[:2], script, flags


def memory_held(result):
    """{rank: {"parameters": MB, "gradients": MB, "optimizer state": MB}} from each rank's line
    'memory held by this rank: parameters X MB, gradients Y MB, optimizer state Z MB' (FSDP chapters)."""
    import re

    pattern = (r"\[rank (\d+)\] INFO memory held by this rank: "
               r"parameters ([\d.]+) MB, gradients ([\d.]+) MB, optimizer state ([\d.]+) MB")
    return {int(rank): {"parameters": float(params), "gradients": float(grads), "optimizer state": float(optim)}
            for rank, params, grads, optim in re.findall(pattern, result.stdout)}


def checkpoint_weights(checkpoint_dir, scratch_dir):
    """A checkpoint's whole weights {name: tensor}: model.pt (chapters 01-03), or the shards every rank wrote with
    torch.distributed.checkpoint (chapters 04-07) gathered by torch's own converter into a file in scratch_dir."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / "model.pt").exists():
        return torch.load(checkpoint_dir / "model.pt", map_location="cpu", weights_only=True)
    gathered = Path(scratch_dir) / f"{checkpoint_dir.parent.name}-{checkpoint_dir.name}.pt"
    dcp_to_torch_save(checkpoint_dir, gathered)
    return torch.load(gathered, map_location="cpu", weights_only=True)["model"]


def train_with_a_restart(chapter, env, workdir, *args, stop_after, nproc=None, experiment="resumed"):
    """Train with --exit-after-steps STOP_AFTER, check that this left that step's checkpoint alone, then run the same
    command again, which must resume from it. Returns the second run's (result, experiment directory)."""
    _, experiment_dir = train(chapter, env, workdir, *args, "--exit-after-steps", stop_after, nproc=nproc,
                              experiment=experiment)
    checkpoints = [path.name for path in experiment_dir.glob("checkpoint-*")]
    assert checkpoints == [f"checkpoint-{int(stop_after):08d}"], checkpoints
    result, experiment_dir = train(chapter, env, workdir, *args, nproc=nproc, experiment=experiment)
    assert f"resumed from {experiment_dir / checkpoints[0]}" in result.stdout, result.stdout[-3000:]
    return result, experiment_dir


def train_until_signalled(chapter, env, workdir, *args, signals, nproc=None, to="workers", experiment="signalled",
                          timeout=300):
    """Start a chapter's run like train(); for each (condition, signal) of signals in turn, once condition(experiment
    directory, stderr so far) is true, send the signal to its training processes (to="workers": each of them, as
    Slurm signals every task of a job step; to="launcher": the process started, torchrun or the one process, as
    Kubernetes signals a container's first process). Returns (result, experiment directory, seconds from the first
    signal to the launcher's exit)."""
    import time

    launcher = [sys.executable] if nproc is None else torchrun(nproc)
    experiment_dir = Path(workdir) / "outputs" / experiment
    command = [*launcher, script(chapter), *FAST_ARGS, "--save-dir", experiment_dir.parent, "-e", experiment, *args]
    started, deadline, signalled_at = BackgroundRun(command, env, workdir), time.monotonic() + timeout, None
    for condition, number in signals:
        while not condition(experiment_dir, started.output()[1]):
            assert started.process.poll() is None, (f"exit {started.process.returncode} before {number!r}: "
                                                    f"{command}\n{started.output()[1][-3000:]}")
            assert time.monotonic() < deadline, f"no {number!r} after {timeout}s: {command}"
            time.sleep(0.05)
        signalled_at = signalled_at or time.monotonic()
        for pid in [started.process.pid] if to == "launcher" else training_processes(command):
            os.kill(pid, number)
    result = started.wait(timeout)
    return result, experiment_dir, time.monotonic() - signalled_at


def training_processes(command):
    """The process ids whose command line is the training script's part of command (its script and arguments), but
    not a launcher: a torchrun agent's workers, or the one process. A warm-started process's stand-in (tests/warm_start)
    is found so and relays the signal."""
    script_part = "\0".join(map(str, command[command.index(next(part for part in command
                                                                 if str(part).endswith("train_llm.py"))):]))
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode()
        except (OSError, ValueError):
            continue
        if proc.name.isdigit() and script_part in cmdline and "torch.distributed.run" not in cmdline:
            pids.append(int(proc.name))
    return pids


def logged_step(step):
    """A condition of train_until_signalled: the run has logged step (rank 0's metrics.jsonl)."""
    def logged(experiment_dir, stderr):
        metrics = experiment_dir / "metrics.jsonl"
        return metrics.exists() and f'{{"step": {step},' in metrics.read_text()
    return logged


def printed(text):
    """A condition of train_until_signalled: the run has written text to stderr (a fault's line)."""
    return lambda experiment_dir, stderr: text in stderr


def loss_and_weight_differences(experiment_a, experiment_b, checkpoint_name):
    """How far two runs of the same steps are apart: the largest difference of their logged losses, and of the
    weights in their checkpoint_name folders."""
    return (max_difference(read_losses(experiment_a), read_losses(experiment_b)),
            largest_weight_difference(Path(experiment_a) / checkpoint_name, Path(experiment_b) / checkpoint_name))


def model_without_chat_template(tmp_path):
    """A copy of the tiny model's folder without its chat template."""
    import shutil

    model_dir = Path(tmp_path) / "no-chat-template"
    shutil.copytree(TINY_MODEL, model_dir, ignore=shutil.ignore_patterns("chat_template.jinja"))
    return model_dir


class FakeFlashAttention:
    """flash-attn's two functions, computed with PyTorch's SDPA on the CPU, in the (tokens, heads, head_dim) layout
    flash-attn uses: what transformers' flash-attention path calls, on a machine without flash-attn. Counts the
    calls; the varlen function attends within each sequence the boundaries cu_seqlens give."""

    def __init__(self):
        self.calls = {"flash_attn_func": 0, "flash_attn_varlen_func": 0}

    @staticmethod
    def attention(q, k, v, causal, scale):
        import torch

        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), is_causal=causal, scale=scale,
            enable_gqa=True)
        return out.transpose(-3, -2)

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
        self.calls["flash_attn_func"] += 1
        return self.attention(q, k, v, causal, softmax_scale)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False):
        import torch

        self.calls["flash_attn_varlen_func"] += 1
        assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
        bounds = cu_seqlens_q.tolist()
        assert bounds == cu_seqlens_k.tolist() and bounds[-1] == q.shape[0]
        assert max_seqlen_q == max(end - start for start, end in zip(bounds, bounds[1:]))
        return torch.cat([self.attention(q[start:end], k[start:end], v[start:end], causal, softmax_scale)
                          for start, end in zip(bounds, bounds[1:])])


# NOTE: clipping at the default --max-grad-norm 1.0 binds at every step of these tiny runs (chapter 01's gradient
# norms are 1.9 to 5.8); at this threshold it binds at none, so the run applies its gradients as computed.
NO_CLIPPING = ["--max-grad-norm", "1000"]
# NOTE: fp32 sums of squares of 1M-element gradients added in another order (shards, micro-batches, stages) move the
# norm by ~1e-5 of itself at step 1 and ~1e-4 by step 10; a gradient 2x or 1/2 too large is off by 1.
GRAD_NORM_TOLERANCE = 3e-4


def grad_norm_difference(reference_dir, experiment_dir, clipped, max_grad_norm=None):
    """The largest relative difference of two runs' logged gradient norms, step by step, after checking that
    clipping at max_grad_norm (1.0, or NO_CLIPPING's with clipped=False) bound at every step of the reference run
    (clipped=True) or at none (clipped=False); clipped=None leaves that unchecked (a fine-tuning run's norms cross
    1.0). The experiment's norms, equal to the reference's, are on the same side.

    NOTE: once clipping binds, AdamW's update does not depend on the gradients' scale, and unclipped it hardly does
    (it divides by their running size): gradients summed where they must be averaged leave the losses and weights
    as they are, and only the norm shows them.
    """
    max_grad_norm = max_grad_norm or (1.0 if clipped else float(NO_CLIPPING[1]))
    reference, experiment = read_metrics(reference_dir), read_metrics(experiment_dir)
    assert [record["step"] for record in experiment] == [record["step"] for record in reference]
    norms = [record["grad_norm"] for record in reference]
    assert clipped is None or all((norm > max_grad_norm) == clipped for norm in norms), \
        f"clipping at {max_grad_norm} was meant to bind at {'every' if clipped else 'no'} step: norms {norms}"
    return max(abs(record["grad_norm"] / reference_record["grad_norm"] - 1)
               for record, reference_record in zip(experiment, reference))


def quick_cases(cases, *quick):
    """cases for pytest.mark.parametrize, those named in quick marked `quick` (the quick tier: tests/README.md)."""
    import pytest

    return [pytest.param(case, marks=pytest.mark.quick) if case in quick else case for case in cases]


# The family-by-chapter matrix: tiny configs of the causal-LM families people fine-tune and pre-train today, written
# by the tests (conftest.py's family_models) with the bundled tokenizer. Every chapter trains each family as chapter
# 01 does, or stops before the first step with one line (FAMILY_REFUSALS). The mixtures of experts leave
# output_router_logits false, as their hub configs do: only chapters 01 and 10 train the load-balancing loss.
FAMILY_COMMON = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=0, eos_token_id=1,
                     pad_token_id=None, tie_word_embeddings=False, initializer_range=0.02)
FAMILY_MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.01, output_router_logits=False)
FAMILIES = {
    "Llama": dict(model_type="llama"),
    "Llama, tied head": dict(model_type="llama", tie_word_embeddings=True),
    "Qwen2 (biases)": dict(model_type="qwen2"),
    "Qwen3 (q/k norms)": dict(model_type="qwen3"),
    "Mistral (sliding window)": dict(model_type="mistral", sliding_window=128),
    "Gemma 3 (tied, 4 norms)": dict(model_type="gemma3_text", tie_word_embeddings=True, sliding_window=128,
                                    query_pre_attn_scalar=16),
    "OLMo 2 (norms over all heads)": dict(model_type="olmo2"),
    "Phi-3 (fused projections)": dict(model_type="phi3"),
    "Mixtral (MoE)": dict(model_type="mixtral", num_local_experts=4, **FAMILY_MOE),
    "Qwen2-MoE (shared expert)": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, **FAMILY_MOE),
    "DeepSeek-V3 (MLA, shared expert)": dict(model_type="deepseek_v3", n_routed_experts=4, n_shared_experts=1,
                                             moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
                                             topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=8,
                                             **FAMILY_MOE),
}
MOE_FAMILIES = [name for name, config in FAMILIES.items() if "num_experts_per_tok" in config]
# Each chapter's layout in the matrix: (processes, flags), every one a global batch of 4 sequences of 32 tokens.
MATRIX_LAYOUTS = {
    "01": (None, ["--batch-size", "4"]),
    "02": (2, ["--batch-size", "2"]),
    "03": (2, ["--batch-size", "2"]),
    "04": (2, ["--batch-size", "2"]),
    "05": (2, ["--batch-size", "2", "--eval-fraction", "0"]),
    "06": (2, ["--batch-size", "4"]),
    "07": (2, ["--tp", "2", "--batch-size", "4"]),
    "08": (2, ["--pp", "2", "--batch-size", "4", "--pp-microbatches", "2"]),
    "09": (2, ["--cp", "2", "--batch-size", "4"]),
    # NOTE: DeepSeek-V3's selection bias left as built, as chapter 01 leaves it (test_10 checks its update).
    "10": (2, ["--ep", "2", "--batch-size", "2", "--expert-bias-rate", "0"]),
    "11": (4, ["--tp", "2", "--pp", "2", "--batch-size", "4"]),
}
MATRIX_ARGS = ["--seq-length", "32", "--max-steps", "2", "--wandb-mode", "disabled"]
TIED, TENSOR_PARALLEL = ["Llama, tied head", "Gemma 3 (tied, 4 norms)"], ["06", "07", "11"]
# (family, chapter) -> the start of the one line the chapter stops with; every other cell trains.
FAMILY_REFUSALS = {
    **{(family, chapter): "tie_word_embeddings: the first and last stages cannot share one weight"
       for family in TIED for chapter in ["08", "11"]},
    **{(family, "09"): "the model has sliding-window attention"
       for family in ["Mistral (sliding window)", "Gemma 3 (tied, 4 norms)"]},
    **{(family, chapter): f"tensor parallelism has no plan for {weight}"
       for chapter in TENSOR_PARALLEL for family, weight in [
           ("Phi-3 (fused projections)", "self_attn.qkv_proj.weight"), ("Mixtral (MoE)", "mlp.gate.weight"),
           ("Qwen2-MoE (shared expert)", "mlp.gate.weight"),
           ("DeepSeek-V3 (MLA, shared expert)", "self_attn.q_a_proj.weight")]},
    **{("OLMo 2 (norms over all heads)", chapter): "self_attn.q_norm of Olmo2DecoderLayer normalizes all heads together"
       for chapter in TENSOR_PARALLEL},
    **{(family, "10"): "--ep 2, but" for family in FAMILIES if family not in MOE_FAMILIES},
}


def family_folder_name(family):
    import re

    return re.sub(r"[^a-z0-9]+", "-", family.lower()).strip("-")


def write_family_models(folder):
    """Each family's model folder in folder: its config.json (FAMILY_COMMON and its own entries) and the bundled
    tokenizer; "corpus": the first 15 texts of the bundled corpus, enough for the matrix's 2 steps (each family's
    tokenizer is another folder, so each tokenizes the corpus anew); and "pretrained": the Llama family with weights
    (transformers' own initialization, not the chapters' seeded one), as save_pretrained() writes them.
    Returns {family, "corpus" or "pretrained": path}."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folders = {"corpus": Path(folder) / "corpus.jsonl", "pretrained": Path(folder) / "llama-pretrained"}
    folders["corpus"].parent.mkdir(parents=True, exist_ok=True)
    folders["corpus"].write_text("".join((TINY_CORPUS / "train.jsonl").read_text().splitlines(keepends=True)[:15]))
    for family, config in FAMILIES.items():
        folders[family] = Path(folder) / family_folder_name(family)
        folders[family].mkdir(parents=True, exist_ok=True)
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(TINY_MODEL / name, folders[family] / name)
        (folders[family] / "config.json").write_text(json.dumps({**FAMILY_COMMON, **config}, indent=1))
    if not (folders["pretrained"] / "model.safetensors").exists():
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folders["Llama"]), dtype=torch.float32)
        model.save_pretrained(folders["pretrained"])
        for name in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(TINY_MODEL / name, folders["pretrained"] / name)
    return folders


def matrix_job(runs, env, chapter, family_models):
    """One job of tests/many_runs.py (runs: SharedRuns) training every family in chapter's MATRIX_LAYOUTS layout, the
    buffers checked: {family: {"exit": code, "error": line or None, "buffers": [line per rank], "metrics": [...]}}."""
    import re

    nproc, flags = MATRIX_LAYOUTS[chapter]
    runs_file = runs.workdir / f"matrix-{chapter}.json"
    experiments = {family: f"matrix-{chapter}-{family_folder_name(family)}" for family in FAMILIES}
    job = [["-m", str(family_models[family]), "-e", experiments[family]] for family in FAMILIES]
    if chapter >= "04":
        # NOTE: the pretrained Llama, one step; chapter 10 trains a dense model at --ep 1 (chapter 04's FSDP).
        job.append(["-m", str(family_models["pretrained"]), "-e", f"matrix-{chapter}-pretrained", "--max-steps", "1",
                    *(["--ep", "1"] if chapter == "10" else [])])
    runs_file.write_text(json.dumps(job))
    flags = [*flags, "-d", family_models["corpus"]]
    launcher = [sys.executable] if nproc is None else torchrun(nproc)
    result, _ = runs.train(chapter, {**env, "MANY_RUNS_BUFFERS": "1"}, *MATRIX_ARGS, *flags, nproc=nproc,
                           launcher=[*launcher, MANY_RUNS, runs_file])
    cells = {}
    for number, family in enumerate(FAMILIES):
        lines = re.findall(rf"\[rank (\d+)\] run {number}: (.*)", result.stdout)
        metrics = runs.workdir / "outputs" / experiments[family] / "metrics.jsonl"
        cells[family] = {"exit": {line for _, line in lines if line.startswith("exit ")},
                         "error": next((line for _, line in lines if line.startswith("error: ")), None),
                         "buffers": [line for _, line in lines if line.startswith("buffers ")],
                         "metrics": read_metrics(metrics.parent) if metrics.exists() else None}
    pretrained = runs.workdir / "outputs" / f"matrix-{chapter}-pretrained"
    cells["pretrained"] = read_metrics(pretrained) if (pretrained / "metrics.jsonl").exists() else None
    return cells


def check_family_matrix(chapter, runs, env, family_models):
    """Every family in chapter trains as in chapter 01 (losses within 1e-5, gradient norms GRAD_NORM_TOLERANCE), its
    buffers its constructor's on every rank, or every rank stops with FAMILY_REFUSALS' line. Returns the cells."""
    nproc = MATRIX_LAYOUTS[chapter][0] or 1
    reference, cells = matrix_job(runs, env, "01", family_models), matrix_job(runs, env, chapter, family_models)
    problems = []
    if chapter >= "04":
        # The pretrained weights load into this chapter's sharding: its first loss is chapter 05's, not the seed's.
        first, expected = cells.pop("pretrained"), matrix_job(runs, env, "05", family_models)["pretrained"]
        seeded = reference["Llama"]["metrics"][0]["loss"]
        if not first or abs(first[0]["loss"] - expected[0]["loss"]) > 1e-5 or abs(first[0]["loss"] - seeded) < 1e-3:
            problems.append(f"pretrained: first loss {first and first[0]['loss']}, chapter 05's {expected[0]['loss']}, "
                            f"the seed's {seeded}")
    for family, cell in cells.items():
        if family == "pretrained":
            continue
        refusal = FAMILY_REFUSALS.get((family, chapter))
        if refusal is not None:
            if cell["exit"] != {"exit 1"} or not (cell["error"] or "").startswith(f"error: {refusal}"):
                problems.append(f"{family}: expected the one line 'error: {refusal}...', got {cell['exit']} "
                                f"{cell['error']}")
            continue
        if cell["exit"] != {"exit 0"} or cell["metrics"] is None:
            problems.append(f"{family}: did not train: {cell['exit']} {cell['error']}")
            continue
        expected = reference[family]["metrics"]
        losses = max(abs(a["loss"] - b["loss"]) for a, b in zip(cell["metrics"], expected))
        norms = max(abs(a["grad_norm"] / b["grad_norm"] - 1) for a, b in zip(cell["metrics"], expected))
        cell["loss_difference"], cell["norm_difference"] = losses, norms
        if len(cell["metrics"]) != len(expected) or losses > 1e-5 or norms > GRAD_NORM_TOLERANCE:
            problems.append(f"{family}: losses {losses:.1e} and gradient norms {norms:.1e} from chapter 01's")
        if len(cell["buffers"]) != nproc or not all(line.startswith("buffers equal") for line in cell["buffers"]):
            problems.append(f"{family}: {cell['buffers']}")
    assert not problems, f"chapter {chapter}:\n" + "\n".join(problems)
    return cells


# What a refusal's line starts with -> the matrix table's word for it.
REFUSAL_WORDS = {"tie_word_embeddings": "tied head", "the model has sliding-window": "sliding window",
                 "tensor parallelism has no plan": "no TP plan", "self_attn.q_norm": "norm over all heads",
                 "--ep 2, but": "dense"}
MATRIX_BEGIN, MATRIX_END = "<!-- table: family matrix, from tests/helpers.py's FAMILY_REFUSALS -->", "<!-- end of table -->"


def family_matrix_table():
    """The family-by-chapter matrix in Markdown, between its markers: ✓ where the chapter trains the family as chapter
    01 does (the tests check it), else the word for the one line it stops with."""
    chapters = sorted(MATRIX_LAYOUTS)
    rows = [f"|family|{'|'.join(chapters)}|", f"|---|{':---:|' * len(chapters)}"]
    for family in FAMILIES:
        cells = []
        for chapter in chapters:
            refusal = FAMILY_REFUSALS.get((family, chapter))
            cells.append("✓" if refusal is None else next(word for start, word in REFUSAL_WORDS.items()
                                                          if refusal.startswith(start)))
        rows.append(f"|{family}|{'|'.join(cells)}|")
    return "\n".join([MATRIX_BEGIN, "", *rows, "", MATRIX_END])
