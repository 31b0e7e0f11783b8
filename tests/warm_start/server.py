"""A warm start for the test suite's Python processes: import the libraries once, fork a process per command.

Every chapter process a test starts spends 6 to 12 seconds of a 2-core CPU importing torch, transformers, datasets
and wandb before its first line runs, and a short test run trains for under a second. This server imports them once
per test session. The processes the tests start (directly, through torchrun, or through a tool) begin as ordinary
interpreters; sitecustomize.py in this folder hands each one's command, environment, working folder and standard
streams to this server, which forks a child with the libraries already imported to run the command, and reports its
exit status back. The script, its arguments, torchrun, gloo and every check are the real ones: only the imports are
shared, and a command whose import-time settings differ from the server's runs the ordinary way (sitecustomize.py).
What a fork does not give a process of its own: Python's string-hash seed (every child iterates a set of strings in
the same order, where cold ranks could differ: chapter 03's restart test, diagnosing-errors and the equivalence
test in test_repo.py start cold ranks) and a command line (ps shows the server's; diagnosing-errors starts cold).

Protocol on the Unix socket, one JSON object per line: the client sends the request (argv, the script path or module,
cwd, environment) together with its file descriptors 0, 1 and 2; the server answers {"pid": N}, relays any
{"signal": S} the client sends to the child, and ends with {"exit": code} or {"signal": S}; or, when it cannot fork,
answers {"cold": true} and the client runs the command itself. When the client goes away without waiting (it was
killed), the server kills the child's process group; a client that dies at any point never stops the server.
"""

import gc
import json
import os
import selectors
import signal
import socket
import sys
import tempfile

# NOTE: what the chapters and the tools import, and the lazily loaded parts of transformers that building a Llama
# model loads (about 3 s of its own on this CPU).
WARM_IMPORTS = """
import torch, torch.distributed, torch.distributed.run, torch.distributed.checkpoint, torch.distributed.device_mesh
import torch.distributed.fsdp, torch.distributed.tensor, torch.distributed.tensor.parallel, torch.distributed.pipelining
import torch.distributed.checkpoint.state_dict, torch.distributed.elastic.multiprocessing.errors
import torch.distributed.algorithms._checkpoint.checkpoint_wrapper, torch.distributed.optim, torch.nn.parallel
import torch.utils.data, datasets, wandb, tqdm, tokenizers, huggingface_hub, matplotlib
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast
from transformers.models.llama import modeling_llama
import transformers.masking_utils, transformers.modeling_utils
import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend
"""
# NOTE: the signals a client relays (sitecustomize.py).
RELAYED = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2}


def main():
    socket_path = sys.argv[1]
    environment_before = dict(os.environ)
    exec(WARM_IMPORTS, {})
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

    dynamic_rendezvous.get_method_name = method_name
    # NOTE: imports set some variables (torch sets TORCHINDUCTOR_CACHE_DIR): a child gets them as a cold start would.
    set_by_imports = {name: value for name, value in os.environ.items() if name not in environment_before}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    # NOTE: the imports' 490,000 objects out of the children's garbage collections (Python's gc.freeze() advice for
    # fork without exec): each full collection in a child walked them all, 0.25 CPU-s (tests/many_runs.py's per run).
    gc.freeze()
    # NOTE: the environment the imports ran under: a client whose import-time settings differ runs on its own.
    with open(socket_path + ".env.json", "w") as file:
        json.dump({"environment": environment_before, "set_by_imports": set_by_imports}, file)
    print("ready", flush=True)

    served = open(socket_path + ".served.jsonl", "a")  # NOTE: what ran warm, for the tests of this server
    cpu_used = open(socket_path + ".cpu.jsonl", "a")  # NOTE: each child's CPU seconds, for the suite's time table
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children = {}  # pid -> the client's connection
    connections = {}  # connection -> [pid, bytes received so far]
    signal.signal(signal.SIGTERM, lambda *_: stop(children))
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is listener:
                connection, _ = listener.accept()
                try:
                    request, fds, after = receive_request(connection)
                except (OSError, ValueError):  # NOTE: the client died before its request was whole
                    connection.close()
                    continue
                # NOTE: blocked across the fork: a signal relayed at once must not run the server's SIGTERM handler
                signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
                try:
                    pid = os.fork()
                except OSError:  # NOTE: no memory for a fork (a loaded machine): the client runs the command itself
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
                    answer(connection, {"cold": True})
                    for fd in fds:
                        os.close(fd)
                    connection.close()
                    continue
                if pid == 0:
                    selector.close()
                    listener.close()
                    served.close()
                    cpu_used.close()
                    for other in connections:
                        other.close()
                    run_child(request, fds, connection, set_by_imports)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
                for fd in fds:
                    os.close(fd)
                served.write(json.dumps({"pid": pid, "argv": request["argv"], "cwd": request["cwd"],
                                         "marker": request["env"].get("TEST_PROCESS_MARKER")}) + "\n")
                served.flush()
                children[pid] = connection
                connections[connection] = [pid, b""]
                selector.register(connection, selectors.EVENT_READ)
                answer(connection, {"pid": pid})
                relay_signals(connection, connections, pid, after)
            else:
                connection = key.fileobj
                pid, pending = connections[connection]
                try:
                    data = connection.recv(4096)
                except OSError:  # NOTE: ECONNRESET: the client was killed with an answer still unread
                    data = b""
                if not data:  # NOTE: the client is gone (killed): so is what it started
                    kill_group(pid)
                    selector.unregister(connection)
                    connections.pop(connection)
                    continue
                relay_signals(connection, connections, pid, pending + data)
        reap(children, connections, selector, cpu_used)


def receive_request(connection):
    """The request, its file descriptors and what came after it (the first signals the client relays)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    try:
        while b"\n" not in data:
            more = connection.recv(1 << 20)
            if not more:
                raise ConnectionError("the client closed its connection mid-request")
            data += more
        request, after = data.split(b"\n", 1)
        return json.loads(request), fds, after
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def relay_signals(connection, connections, pid, data):
    """Deliver each whole {"signal": S} line to the child; keep a partial one for the next read."""
    *lines, connections[connection][1] = data.split(b"\n")
    for line in lines:
        try:
            os.kill(pid, json.loads(line)["signal"])
        except (ProcessLookupError, ValueError, KeyError, TypeError):
            pass  # NOTE: the child is gone, or a line that is no signal: the server carries on


def answer(connection, message):
    """Send the client a message; one that is gone (killed) is noticed when its connection is next read."""
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def reap(children, connections, selector, cpu_used):
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is None:
            continue
        cpu_used.write(json.dumps({"pid": pid, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)}) + "\n")
        cpu_used.flush()
        if os.WIFSIGNALED(status):
            message = {"signal": os.WTERMSIG(status)}
        else:
            message = {"exit": os.WEXITSTATUS(status)}
        answer(connection, message)
        if connection in connections:
            selector.unregister(connection)
            connections.pop(connection)
        connection.close()


def kill_group(pid):
    """Kill the child and its process group (none yet if it has not reached its setsid())."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def stop(children):
    for pid in list(children):
        kill_group(pid)
    sys.exit(0)


def run_child(request, fds, connection, set_by_imports):
    """In the forked child: become the client's process (streams, folder, environment, argv), run, exit."""
    import atexit
    import runpy
    import threading

    os.setsid()
    be_nice(request.get("nice", 0))
    # NOTE: the CPUs the client may run on: a launcher's binding (mpirun's cores, srun's CPUs) holds for the command.
    if request.get("affinity"):
        os.sched_setaffinity(0, request["affinity"])
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    connection.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    tempfile.tempdir = None  # NOTE: found again from the client's TMPDIR
    sys.argv = request["argv"]
    sys.path[:] = request["sys_path"]
    run_sitecustomize()
    sys.path.insert(0, os.path.dirname(request["path"]) if request["path"] else os.getcwd())
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    code = 0
    try:
        if request["path"]:
            runpy.run_path(request["path"], run_name="__main__")
        else:
            # NOTE: as in a cold start, the module runs as __main__ only, not also under its own name.
            sys.modules.pop(request["module"], None)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_request:
        if exit_request.code is None:
            code = 0
        elif isinstance(exit_request.code, int):
            code = exit_request.code
        else:
            # NOTE: in one write, as the ranks of a job share one stderr: print()'s two writes can interleave.
            sys.stderr.write(f"{exit_request.code}\n")
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def method_name(depth=2):
    """torch's dynamic_rendezvous.get_method_name, which names the method of a rendezvous event it records, without
    inspect.stack(): that looks up every frame's module, a scan of every loaded module per frame, 0.3 CPU seconds of
    each torchrun agent among the server's modules. The same name: the function of the frame `depth` levels up."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def be_nice(nice):
    """Run at the client's niceness (a background run of conftest.py keeps to the cores tests leave idle), in this
    session's scheduling group too: with autogroup scheduling the kernel shares the CPUs between sessions first,
    and a process's own niceness counts only within its session."""
    os.nice(max(0, nice - os.nice(0)))
    if nice > 0:
        try:
            with open("/proc/self/autogroup", "w") as autogroup:
                autogroup.write(str(nice))
        except OSError:
            pass  # NOTE: a kernel without autogroup scheduling: the process's niceness is enough


def run_sitecustomize():
    """Start up as the client did: run the first sitecustomize on its path (this folder's one runs the one it hides,
    such as the tests' fault injection; the GPU card's runs this folder's one first, then adds its hooks)."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or not spec.origin:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    os.environ["WARM_START_IN_CHILD"] = "1"
    try:
        spec.loader.exec_module(module)
    finally:
        del os.environ["WARM_START_IN_CHILD"]


if __name__ == "__main__":
    main()
