"""Faults the tests inject into a chapter's processes, without a line of fault code in the chapters themselves.

Python imports this file at start-up when its folder is on PYTHONPATH. Each fault is switched on by a variable:

FAULT_KILL_ON_CALL="torch.save:5"   SIGKILL this process inside the 5th call of torch.save, after that call wrote its
                                    file: a crash in the middle of writing a checkpoint.
FAULT_KILL_AFTER_STEPS=3            SIGKILL this process after its 3rd optimizer step, only on rank FAULT_RANK
FAULT_RANK=1                        (default 0), and only once: the file FAULT_ONCE_FILE is created on the way down,
FAULT_ONCE_FILE=/tmp/x              so a restarted process trains on.
"""

import os
import signal

if os.environ.get("FAULT_KILL_ON_CALL"):
    import importlib

    import torch  # noqa: F401  (the patched functions live in torch)

    target, count = os.environ["FAULT_KILL_ON_CALL"].rsplit(":", 1)
    module_name, function_name = target.rsplit(".", 1)
    module = importlib.import_module(module_name)
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
