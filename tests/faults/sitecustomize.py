"""Faults the tests inject into a chapter's processes, without a line of fault code in the chapters themselves.

Python imports this file at start-up when its folder is on PYTHONPATH. Each fault is switched on by a variable:

FAULT_KILL_ON_CALL="torch.save:5"   SIGKILL this process inside the 5th call of torch.save, after that call wrote its
                                    file: a crash in the middle of writing a checkpoint. A method works too:
                                    "transformers.cache_utils.DynamicCache.__init__:1" dies when a KV cache is built.
FAULT_KILL_AFTER_STEPS=3            SIGKILL this process after its 3rd optimizer step, only on rank FAULT_RANK
FAULT_RANK=1                        (default 0), and only once: the file FAULT_ONCE_FILE is created on the way down,
FAULT_ONCE_FILE=/tmp/x              so a restarted process trains on.

Not a fault, but set from outside the same way:
COMPILE_BACKEND=aot_eager           the backend of every torch.compile() call (the chapters' --compile): dynamo and
                                    AOT autograd without inductor's C++, seconds instead of minutes on a CPU.
"""

import os
import signal

if os.environ.get("FAULT_KILL_ON_CALL"):
    import importlib

    import torch  # noqa: F401  (the patched functions live in torch)

    target, count = os.environ["FAULT_KILL_ON_CALL"].rsplit(":", 1)
    owner_name, function_name = target.rsplit(".", 1)
    # NOTE: the owner is a module, or a class inside one: import the longest prefix that is a module.
    owner_path = owner_name.split(".")
    for split in range(len(owner_path), 0, -1):
        try:
            module = importlib.import_module(".".join(owner_path[:split]))
            break
        except ImportError:
            continue
    for attribute in owner_path[split:]:
        module = getattr(module, attribute)
    original = getattr(module, function_name)
    calls = [0]

    def call_then_die(*args, **kwargs):
        result = original(*args, **kwargs)
        calls[0] += 1
        if calls[0] == int(count):
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(module, function_name, call_then_die)

if os.environ.get("FAULT_KILL_AFTER_STEPS"):
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    steps = [0]
    once_file = os.environ["FAULT_ONCE_FILE"]
    this_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))

    def die_after_steps(optimizer, args, kwargs):
        steps[0] += 1
        if steps[0] == int(os.environ["FAULT_KILL_AFTER_STEPS"]) and this_rank == os.environ.get("FAULT_RANK", "0"):
            if not os.path.exists(once_file):
                open(once_file, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(die_after_steps)

# FAULT_RAISE_AFTER_STEPS=2           raise a RuntimeError from this process's 2nd optimizer step, only on rank
# FAULT_RANK=1                        FAULT_RANK (default 0): a bug in one rank of a distributed job. The message
#                                     starts with "injected fault" and says the rank, the step and the Unix time.
if os.environ.get("FAULT_RAISE_AFTER_STEPS"):
    import time

    from torch.optim.optimizer import register_optimizer_step_post_hook

    raise_steps = [0]
    raise_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))

    def raise_after_steps(optimizer, args, kwargs):
        raise_steps[0] += 1
        if raise_steps[0] == int(os.environ["FAULT_RAISE_AFTER_STEPS"]) and raise_rank == os.environ.get("FAULT_RANK", "0"):
            raise RuntimeError(f"injected fault on rank {raise_rank} after {raise_steps[0]} optimizer steps "
                               f"at {time.time():.3f}")

    register_optimizer_step_post_hook(raise_after_steps)

# FAULT_STALE_LISTING=checkpoint-2    on rank FAULT_RANK (default 0), Path.glob("checkpoint-*") lists just these
# FAULT_RANK=1                        folders (comma-separated), whatever the folder holds: the stale directory
#                                     listing that a node of a shared file system (NFS, Lustre) can keep for seconds.
if os.environ.get("FAULT_STALE_LISTING"):
    import pathlib

    listing_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if listing_rank == os.environ.get("FAULT_RANK", "0"):
        original_glob = pathlib.Path.glob

        def stale_glob(self, pattern, *args, **kwargs):
            if pattern == "checkpoint-*":
                return iter([self / name for name in os.environ["FAULT_STALE_LISTING"].split(",")])
            return original_glob(self, pattern, *args, **kwargs)

        pathlib.Path.glob = stale_glob

# FAULT_SLEEP_ON_CALL="datasets.load_from_disk:15"   sleep 15 seconds before the first call of that function, only on
# FAULT_RANK=0                                       rank FAULT_RANK (default 0), and say so on stderr: a slow rank,
#                                                    e.g. rank 0 preparing a large data set while the others wait.
#                                                    A third field "every" sleeps before every call (slow steps).
if os.environ.get("FAULT_SLEEP_ON_CALL"):
    import importlib
    import sys
    import time

    sleep_target, sleep_seconds, *sleep_every = os.environ["FAULT_SLEEP_ON_CALL"].split(":")
    sleep_rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    if sleep_rank == os.environ.get("FAULT_RANK", "0"):
        sleep_module_name, sleep_function_name = sleep_target.rsplit(".", 1)
        sleep_module = importlib.import_module(sleep_module_name)
        not_slept = getattr(sleep_module, sleep_function_name)
        slept = [False]

        def sleep_then_call(*args, **kwargs):
            if not slept[0] or sleep_every == ["every"]:
                slept[0] = True
                print(f"injected fault: rank {sleep_rank} sleeps {sleep_seconds}s before {sleep_target}", file=sys.stderr,
                      flush=True)
                time.sleep(float(sleep_seconds))
            return not_slept(*args, **kwargs)

        setattr(sleep_module, sleep_function_name, sleep_then_call)

# FAULT_STARVE_GLOO_THREADS=1   after init_process_group(), the threads it started (gloo's workers) get the CPU only
#                               when nothing else wants it (SCHED_IDLE), and the process runs on one CPU: the main
#                               thread, woken by a finished collective, runs on before the worker that woke it has
#                               freed its work, as on a busy node. It makes the exit deadlock of pytorch #56297 sure.
if os.environ.get("FAULT_STARVE_GLOO_THREADS"):
    import torch.distributed

    not_starved = torch.distributed.init_process_group

    def init_then_starve(*args, **kwargs):
        threads_before = set(os.listdir("/proc/self/task"))
        not_starved(*args, **kwargs)
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[int(os.environ.get("LOCAL_RANK", "0")) % len(cpus)]})
        for thread_id in set(os.listdir("/proc/self/task")) - threads_before:
            os.sched_setaffinity(int(thread_id), os.sched_getaffinity(0))
            os.sched_setscheduler(int(thread_id), os.SCHED_IDLE, os.sched_param(0))

    torch.distributed.init_process_group = init_then_starve

if os.environ.get("COMPILE_BACKEND"):
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend=os.environ["COMPILE_BACKEND"])
