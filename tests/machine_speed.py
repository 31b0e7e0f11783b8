"""How fast this machine runs the tests' kind of torch work now: the seconds a fixed workload takes (a small model's
forward, backward and AdamW step, dispatch-bound as the tests' tiny runs are), run on every core at once.

conftest.py runs it when the session starts and when it ends; the suite's budget and the dry runs' CPU bounds are set
for the machine the suite was timed on, and scale by SLOWDOWN when this one is slower (CI machines have run the same
commit 2x slower than on other days). `python tests/machine_speed.py` prints the slowdown.
"""

import os
import statistics
import subprocess
import sys
import time

# The workload's median seconds, one copy per core on the 2-core machine that measured tests/times.json.
REFERENCE_S = 0.9


def workload_seconds(steps=1000):
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters())
    inputs = torch.randn(32, 64)
    started = time.perf_counter()
    for _ in range(steps):
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - started


def slowdown(copies=None):
    """This machine's time for the workload over REFERENCE_S (at least 1), with a copy on each core."""
    copies = copies or os.cpu_count() or 1
    runs = [subprocess.Popen([sys.executable, __file__, "--workload"], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(copies)]
    seconds = [float(run.communicate(timeout=300)[0]) for run in runs]
    return max(1.0, statistics.median(seconds) / REFERENCE_S)


if __name__ == "__main__":
    print(workload_seconds() if sys.argv[1:] == ["--workload"] else f"{slowdown():.2f}")
