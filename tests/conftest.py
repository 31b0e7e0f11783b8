"""Fixtures every test file shares: the session's scratch folder, the environment a chapter's processes run in,
the training runs several files compare against (chapter 01's reference runs above all), and the tied tiny model.

The helpers that are plain functions (train(), run(), read_losses(), ...) live in helpers.py.
"""

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import helpers
import machine_speed
from helpers import (BACKGROUND_RUNS, QUICK_START_FLAGS, REPO, TINY_MODEL, FakeFlashAttention, SharedBackgroundRun,
                     SharedRuns, in_background, locked, processes_with_marker, script, write_family_models)

WARM_START = Path(__file__).resolve().parent / "warm_start"
SELECTED_FIXTURES = pytest.StashKey[set]()
# pytest-xdist's worker ("gw0", ...) and the number of workers, in a parallel session (pytest.ini's -n).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# The whole suite's budget on the 2-core CI machine: a run of every test that takes longer fails (pytest_sessionfinish).
SUITE_BUDGET_S = 15 * 60
# NOTE: the environment the session started with: a library a test imports in this process may set variables (as
# lightning sets PYTORCH_NVML_BASED_CUDA_CHECK), which must not reach the processes the tests start.
STARTING_ENVIRONMENT = dict(os.environ)
# NOTE: the models tests build in this process run on one thread, as the processes they start do: two threads on
# cores another worker's jobs keep busy spin at every barrier (an 8 s experiment took 56 s in the suite).
os.environ.setdefault("OMP_NUM_THREADS", "1")
TIMES_FILE = Path(__file__).resolve().parent / "times.json"
TIMELINE_FILE = Path(__file__).resolve().parent / "timeline.json"
# What this session ran and how long each test took (the hooks below).
# This process's CPU accounting: each test's CPU seconds here, and which test each process marker belongs to.
CPU = {"tests": {}, "markers": {}}
TIMES = {"started": time.monotonic(), "deselected": 0, "selected": -1, "tests": {}, "timeline": {}, "cpu": []}


def cpu_times():
    """The machine's (idle, total) CPU time so far, in clock ticks (/proc/stat), or None off Linux."""
    try:
        fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    return fields[3] + fields[4], sum(fields[:8])  # NOTE: idle and iowait; user to steal


def sample_cpu(period_s=2.0):
    """Every period_s, (seconds since start, idle, total) into TIMES["cpu"]: where the cores sat idle, and when."""
    while True:
        sample = cpu_times()
        if sample is None:
            return
        TIMES["cpu"].append((round(time.monotonic() - TIMES["started"], 1), *sample))
        time.sleep(period_s)


if WORKER is None:
    threading.Thread(target=sample_cpu, daemon=True).start()


def pytest_configure(config):
    """How much slower than the machine that timed the suite this one runs (machine_speed.py), measured before the
    workers start, who read it from the environment (helpers.SLOWDOWN)."""
    if WORKER is None:
        TIMES["slowdown"] = [machine_speed.slowdown()]
        os.environ["TESTS_SLOWDOWN"] = f"{TIMES['slowdown'][0]:.3f}"
        helpers.SLOWDOWN = TIMES["slowdown"][0]


def pytest_xdist_auto_num_workers(config):
    """pytest.ini's `-n auto`: a worker per two cores (each test's jobs run 2 to 8 processes), 3 to 8 workers.
    NOTE: on 2 cores a third worker runs in the time the others wait (timeouts, Slurm's polling): 7% of it was idle."""
    return min(8, max(3, (os.cpu_count() or 2) // 2))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked `last` run after all the others: the quick start's, whose run trains in the background meanwhile
    (the `background` fixture). In a parallel session a file's tests run on one worker (its module-scoped runs are
    made once), and the `last` tests after every file (pytest.ini's --dist loadgroup)."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
    for item in items:
        last = item.get_closest_marker("last") is not None
        item.add_marker(pytest.mark.xdist_group("last" if last else item.nodeid.split("::")[0]))
    config.stash[SELECTED_FIXTURES] = {name for item in items for name in getattr(item, "fixturenames", ())}
    TIMES["selected"] = len(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    TIMES["selected"] = len(ids)


def pytest_deselected(items):
    TIMES["deselected"] += len(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU seconds in this process (the warm start's children are counted by its server: CPU["markers"]
    ties them to their test). Processes started cold are not counted: when a child is reaped is no test's measure."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    try:
        return (yield)
    finally:
        after = resource.getrusage(resource.RUSAGE_SELF)
        CPU["tests"][item.nodeid.split("@")[0]] = round(
            after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)


def pytest_runtest_logreport(report):
    """Each test's time (setup, call and teardown: a shared run counts for the test that first asks for it), without
    the "@group" pytest-xdist appends to its name."""
    nodeid = report.nodeid.split("@")[0]
    TIMES["tests"][nodeid] = TIMES["tests"].get(nodeid, 0.0) + report.duration
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", WORKER or "main")
    started = TIMES["timeline"].get(nodeid, (worker, report.start))[1]
    TIMES["timeline"][nodeid] = (worker, round(started, 1), round(report.stop, 1))


def the_whole_suite_ran(session):
    """Every test of tests/ was selected and ran: no -k, -m, --deselect, -x stop, or narrower paths."""
    config, times = session.config, TIMES
    tests_dir = Path(__file__).resolve().parent
    paths = [(config.invocation_params.dir / arg.split("::")[0]).resolve() for arg in config.args]
    return (times["deselected"] == 0 and not session.shouldfail and not session.shouldstop
            and not config.option.keyword and not config.option.markexpr and not config.option.deselect
            and paths == [tests_dir] and len(times["tests"]) == times["selected"])


def pytest_sessionfinish(session, exitstatus):
    """After a run of the whole suite: each file's time into tests/times.json (tests/time_table.py turns it into
    the table of tests/README.md), and a failure if the suite took longer than SUITE_BUDGET_S, scaled by how much
    slower than the machine that timed it this one ran (the mean of machine_speed.py's slowdown at start and end)."""
    times = TIMES
    basetemp = session.config._tmp_path_factory.getbasetemp()
    if WORKER is not None:
        (basetemp.parent / "shared" / f"cpu-{WORKER}.json").write_text(json.dumps(CPU))
    if WORKER is not None or not the_whole_suite_ran(session):
        return
    total = time.monotonic() - times["started"]
    times["slowdown"].append(machine_speed.slowdown())
    # NOTE: the mean: a machine can slow down during the run (measured 1.00 at the start, 1.34 at the end, the same
    # tests' CPU seconds up 17%). Run the suite alone: a measurement that shares the cores reads high.
    slowdown = sum(times["slowdown"]) / len(times["slowdown"])
    files = {}
    for nodeid, seconds in times["tests"].items():
        files[nodeid.split("::")[0]] = files.get(nodeid.split("::")[0], 0.0) + seconds
    cpu_files = cpu_seconds(basetemp)
    slowest = sorted(times["tests"].items(), key=lambda item: -item[1])  # NOTE: every test, to find the work to cut
    samples = times["cpu"] + [(round(total, 1), *(cpu_times() or (0, 0)))]
    idle = (samples[-1][1] - samples[0][1]) / max(1, samples[-1][2] - samples[0][2]) if len(samples) > 1 else None
    TIMES_FILE.write_text(json.dumps({
        "total_s": round(total, 1), "tests": len(times["tests"]), "budget_s": SUITE_BUDGET_S,
        "slowdown": [round(value, 2) for value in times["slowdown"]],
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "warm_start": os.environ.get("WARM_START") != "0",
        "workers": getattr(session.config.option, "numprocesses", None) or 1,
        "cpu_idle_share": None if idle is None else round(idle, 3),
        "files": {name: round(seconds, 1) for name, seconds in sorted(files.items())},
        "cpu_s": {name: round(seconds, 1) for name, seconds in sorted(cpu_files.items(), key=lambda item: -item[1])},
        "slowest": {nodeid: round(seconds, 1) for nodeid, seconds in slowest}}, indent=1) + "\n")
    # NOTE: not committed: which worker ran what when, and the cores' idle time, to find where a run waits.
    TIMELINE_FILE.write_text(json.dumps({"started": time.time() - total, "tests": times["timeline"],
                                         "cpu": samples}) + "\n")
    if total > SUITE_BUDGET_S * slowdown:
        times["over_budget"] = total, slowdown
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def cpu_seconds(basetemp):
    """The CPU seconds of each test file and background run: the tests' own (each worker's account, or this
    process's) and those of every process the warm start ran for them (its server's account)."""
    accounts = [json.loads(path.read_text()) for path in (basetemp / "shared").glob("cpu-gw*.json")] or [CPU]
    owners = {marker: owner for account in accounts for marker, owner in account["markers"].items()}
    used = {}
    for account in accounts:
        for nodeid, seconds in account["tests"].items():
            used[nodeid.split("::")[0]] = used.get(nodeid.split("::")[0], 0.0) + seconds
    for cpu_file in basetemp.rglob("warm.sock.cpu.jsonl"):
        served = cpu_file.with_name("warm.sock.served.jsonl").read_text().splitlines()
        # NOTE: a test may suffix its marker for a job of its own ("<marker>-<job>", test_diagnosing_errors.py)
        markers = {record["pid"]: (record.get("marker") or "").split("-")[0] for record in map(json.loads, served)}
        for record in map(json.loads, cpu_file.read_text().splitlines()):
            owner = owners.get(markers.get(record["pid"]), "other").split("::")[0]
            used[owner] = used.get(owner, 0.0) + record["cpu_s"]
    return used


def pytest_terminal_summary(terminalreporter):
    if "over_budget" in TIMES:
        total, slowdown = TIMES["over_budget"]
        terminalreporter.write_line(
            f"FAILED: the whole suite took {total:.0f} s, over its budget of {SUITE_BUDGET_S} s (tests/conftest.py's "
            f"SUITE_BUDGET_S) x {slowdown:.2f} (this machine's slowdown, machine_speed.py); tests/times.json has each "
            f"file's time", red=True, bold=True)


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    """This worker's scratch folder: its warm-start server, its caches."""
    return tmp_path_factory.mktemp("session")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory):
    """The folder every worker of a parallel session shares (this session's own when it is not parallel)."""
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if WORKER is not None else root) / "shared"
    folder.mkdir(exist_ok=True)
    return folder


def session_environment(session_dir):
    """Offline, with caches under the session's folder; the tokenized data cache (HF_HOME) is shared by the whole
    session, so the corpus is tokenized once.

    NOTE: wandb is disabled: it costs about 2 s a process. The quick start and chapter 02's README run and failing
    job run it offline, as a reader's runs do when not logged in.
    """
    return {
        **STARTING_ENVIRONMENT,
        "HF_HOME": str(session_dir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "WANDB_DIR": str(session_dir / "wandb"),
        "WANDB_CONFIG_DIR": str(session_dir / "wandb-config"),
        "WANDB_CACHE_DIR": str(session_dir / "wandb-cache"),
        "WANDB_DATA_DIR": str(session_dir / "wandb-data"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # NOTE: inductor compiles in the process: a pool of compile workers, each importing torch, cost 17 CPU-s.
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(WARM_START),
    }


@pytest.fixture(scope="session")
def warm_start(session_dir):
    """The warm-start server (warm_start/server.py) for the session: {"WARM_START_SOCKET": path} for the processes'
    environment, or {} when WARM_START=0 asks for every process to start cold."""
    if os.environ.get("WARM_START") == "0":
        yield {}
        return
    socket_path = str(session_dir / "warm.sock")
    environment = {**session_environment(session_dir), "WARM_START_SOCKET": socket_path}
    log = open(session_dir / "warm-start.log", "w")
    server = subprocess.Popen([sys.executable, WARM_START / "server.py", socket_path], env=environment,
                              stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    ready = server.stdout.readline().strip()
    assert ready == "ready", f"the warm-start server did not start: {(session_dir / 'warm-start.log').read_text()}"
    yield {"WARM_START_SOCKET": socket_path}
    # NOTE: a dead server is not silent: every process after it started cold, and the suite ran slow.
    assert server.poll() is None, f"the warm-start server died: {(session_dir / 'warm-start.log').read_text()[-3000:]}"
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.fixture
def env(request, session_dir, warm_start):
    """The environment for a chapter's processes (session_environment), with the warm-start server and a marker."""
    marker = uuid.uuid4().hex
    CPU["markers"][marker] = request.node.nodeid
    environment = {**session_environment(session_dir), **warm_start, "TEST_PROCESS_MARKER": marker}
    yield environment
    assert not processes_with_marker(marker), "the test left processes running"


@pytest.fixture(scope="session")
def tied_model(session_dir):
    """The bundled tiny model with tie_word_embeddings true: one matrix is both the input embedding and the output
    head, as in Llama 3.2 1B and 3B and the small Qwen2.5 models."""
    folder = session_dir / "tiny-llama-tied"
    if not folder.exists():
        shutil.copytree(TINY_MODEL, folder)
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="session")
def family_models(shared_dir):
    """{family: model folder} of the family-by-chapter matrix (helpers.FAMILIES), written once for all workers."""
    with locked(shared_dir / "family-models.lock"):
        return write_family_models(shared_dir / "family-models")


@pytest.fixture
def fake_flash_attention(monkeypatch):
    """transformers' flash-attention path calling FakeFlashAttention (helpers.py): flash-attn's functions computed by
    SDPA on the CPU. Returns the fake, which counts the calls."""
    import transformers.modeling_flash_attention_utils as flash_utils

    fake = FakeFlashAttention()
    process = flash_utils._lazy_define_process_function(fake.flash_attn_varlen_func)
    # NOTE: transformers 5.24 returns a pair of processing functions (plain, with a KV cache), 5.17 the plain one.
    processes = (process, dict) if hasattr(flash_utils, "_process_with_kvcache_kwargs_fn") else process
    monkeypatch.setattr(flash_utils, "lazy_import_flash_attention", lambda *args, **kwargs: (
        (fake.flash_attn_func, fake.flash_attn_varlen_func, None, None, None), processes))
    return fake


@pytest.fixture(scope="session")
def runs(shared_dir):
    """The runs several tests compare against, each made once per session (by the first worker to ask, in a parallel
    one): chapter 01's reference runs, and a chapter's runs that several of its tests read (SharedRuns)."""
    (shared_dir / "runs").mkdir(exist_ok=True)
    return SharedRuns(shared_dir / "runs")


def quick_start_environment(environment):
    """Chapter 01's quick start: the README's command, stopped after QUICK_START_STEPS, run from a scratch folder (its
    outputs/ land there) and cold, as a reader runs it; on one thread, as the suite's other processes run.

    NOTE: its two threads on cores the workers keep busy spun at every barrier: 1.3 CPU seconds a step against 0.63 on
    one thread."""
    return {**environment, "WANDB_MODE": "offline"}


# NOTE: not niced: the last test waits for it, and niced it got so little of the busy cores that it ran on at the end
# for two minutes, with the other worker done and idle.
# NOTE: stopped after its first QUICK_START_STEPS, as the chapters' CPU commands are shortened: its 200 steps took
# 197 CPU seconds of the busy cores, a tenth of the suite's.
in_background("quick-start", "quick_start", lambda folder: [sys.executable, script("01"), *QUICK_START_FLAGS],
              quick_start_environment, nice=0)


@pytest.fixture(scope="session")
def quick_start(background):
    return background["quick-start"][0]


@pytest.fixture(scope="session", autouse=True)
def background(request, session_dir, shared_dir):
    """The background runs of helpers.BACKGROUND_RUNS whose tests are selected, started now (in a parallel session,
    by the first worker to claim each): {name: (SharedBackgroundRun, its folder)}. Niced (all but the quick start),
    and so are the processes they start warm (tests/warm_start passes the niceness on): they take a core only when
    the tests leave it idle, and a test that reads one waits for it."""
    selected = request.config.stash.get(SELECTED_FIXTURES, set())
    wanted = {name: entry for name, entry in BACKGROUND_RUNS.items() if entry[0] in selected}
    started = {}
    for name, (_, command, environment, nice) in wanted.items():
        folder = shared_dir / "background" / name
        if environment is None:
            run_env = {**session_environment(session_dir), **request.getfixturevalue("warm_start")}
        else:
            run_env = environment(session_environment(session_dir))
        run_env["TEST_PROCESS_MARKER"] = uuid.uuid4().hex
        CPU["markers"][run_env["TEST_PROCESS_MARKER"]] = f"background {name}"
        cwd = REPO if environment is None else folder
        started[name] = (SharedBackgroundRun(folder, command(folder), run_env, cwd, nice=nice), folder)
    yield started
    (shared_dir / f"done-{WORKER}").touch()
    others = [shared_dir / f"done-gw{index}" for index in range(WORKER_COUNT) if WORKER not in (None, f"gw{index}")]
    for run, _ in started.values():
        run.stop(others_done=lambda: all(path.exists() for path in others))
