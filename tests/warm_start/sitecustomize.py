"""The client side of the test suite's warm start (server.py): hand this process's command to the warm server.

Python imports this file at start-up when its folder is on PYTHONPATH (the tests' `env` fixture puts it there). If
WARM_START_SOCKET names a running server, the command is `python [-u] script.py ...` or `python [-u] -m
torch.distributed.run ...`, and every variable read at import time (PYTHON*, HF_*, TORCH*, OMP_*, ...) is
the server's, this process becomes a stand-in: the server forks the command's process, this one relays signals to it
and exits with its exit status (or dies of its signal). Otherwise Python runs the command here.

A sitecustomize later on the path (the tests' fault injection) runs in the process that runs the command: here, or
in the server's child (which also runs one earlier on the path, such as the GPU card's, which runs this one first).
"""

import os
import sys

IMPORT_TIME_PREFIXES = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "DATASETS", "TOKENIZERS", "TORCH", "PYTORCH",
                        "OMP_", "MKL_", "KMP_", "GOMP", "OPENBLAS", "LD_", "CUDA", "TQDM", "MPL", "HOME", "XDG_",
                        "LANG", "LC_")
# NOTE: torchrun's per-worker variables are read when the script runs, not when torch is imported; so are wandb's
# (WANDB_MODE, WANDB_DIR, ...), which wandb.init() reads, the allocator's (at the first CUDA allocation) and the
# rendezvous store's that the launch files set. TMPDIR (srun sets it) may differ too: the server's child finds its
# temporary folder again from its own.
RUN_TIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def import_time_settings(environment, set_by_imports):
    """The variables read at import time, less those the imports set themselves (to the value they set)."""
    return {name: value for name, value in environment.items()
            if name.startswith(IMPORT_TIME_PREFIXES) and not name.startswith(RUN_TIME_PREFIXES)
            and name != "PYTHONPATH" and set_by_imports.get(name) != value}


def warm_request():
    """What the server needs to run this command, or None when it should run here."""
    socket_path = os.environ.get("WARM_START_SOCKET")
    if not socket_path or not os.path.exists(socket_path + ".env.json"):
        return None
    arguments = list(sys.orig_argv[1:])
    if arguments[:1] == ["-u"]:
        arguments = arguments[1:]
    if arguments[:2] == ["-m", "torch.distributed.run"]:
        path, module = None, "torch.distributed.run"
    elif arguments and arguments[0].endswith(".py") or arguments and os.path.basename(arguments[0]) == "torchrun":
        path, module = os.path.abspath(arguments[0]), None
    else:
        return None
    import json

    with open(socket_path + ".env.json") as file:
        server = json.load(file)
    if (import_time_settings(server["environment"], server["set_by_imports"])
            != import_time_settings(os.environ, server["set_by_imports"])):
        return None
    return socket_path, {"argv": sys.argv if path else [sys.argv[0], *arguments[2:]], "path": path,
                         "module": module, "cwd": os.getcwd(), "env": dict(os.environ), "sys_path": sys.path,
                         "nice": os.nice(0), "affinity": sorted(os.sched_getaffinity(0))}


def run_warm(socket_path, request):
    """Hand the command to the server; return only if it asks this process to run the command itself."""
    import json
    import signal
    import socket

    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(socket_path)
    except OSError:
        return  # NOTE: no server (the session is over): run here
    # NOTE: caught from before the request is sent and relayed after it, so no signal is lost to the race.
    caught, seen, sent = [], [], []

    def forward(number, _frame):
        caught.append(number)
        seen.append(number)
        if sent:
            while caught:
                connection.sendall(json.dumps({"signal": caught.pop(0)}).encode() + b"\n")

    def run_here():
        """Run the command in this process after all: its own handlers back, and the signals it got delivered."""
        connection.close()
        for number, handler in handlers.items():
            signal.signal(number, handler)
        for number in seen:
            os.kill(os.getpid(), number)

    relayed = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
    handlers = {number: signal.signal(number, forward) for number in relayed}
    try:
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    except OSError:  # NOTE: the server went away after the connect: it got no whole request, so nothing ran there
        run_here()
        return
    # NOTE: from here on the command runs in the server's child, unless the server could not fork and says so.
    try:
        sent.append(True)
        while caught:
            connection.sendall(json.dumps({"signal": caught.pop(0)}).encode() + b"\n")
        relay(connection, json, signal)
    except ColdStart:
        run_here()
        return
    except BaseException as error:
        print(f"warm start: lost the server's child ({error!r})", file=sys.stderr, flush=True)
    os._exit(1)


class ColdStart(Exception):
    pass


def relay(connection, json, signal):
    """End as the server's child ended: its exit status, or its signal (this process's signals are relayed to it)."""
    received = b""
    while True:
        data = connection.recv(4096)
        if not data:  # NOTE: the server is gone: say so, as a killed process would
            return
        received += data
        while b"\n" in received:
            line, received = received.split(b"\n", 1)
            message = json.loads(line)
            if "cold" in message:
                raise ColdStart
            if "exit" in message:
                os._exit(message["exit"])
            if "signal" in message:
                if message["signal"] not in (signal.SIGKILL, signal.SIGSTOP):  # NOTE: those cannot be handled
                    signal.signal(message["signal"], signal.SIG_DFL)
                os.kill(os.getpid(), message["signal"])
                os._exit(128 + message["signal"])


def run_shadowed_sitecustomize():
    """Run the first sitecustomize after this one's folder on the path, as Python would have had this one not hidden
    it."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(entry or ".") for entry in sys.path]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path[entries.index(here) + 1:])
    if spec is not None and spec.origin:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_request = None if os.environ.get("WARM_START_IN_CHILD") else warm_request()
if _request is not None:
    run_warm(*_request)
run_shadowed_sitecustomize()
