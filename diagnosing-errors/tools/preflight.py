"""Pre-flight check: run it with the same launcher, nodes and GPUs as the real job, before the real job.

    python diagnosing-errors/tools/preflight.py                                    # one process
    torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/preflight.py   # one node
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 diagnosing-errors/tools/preflight.py
    srun --ntasks-per-node 8 --gpus-per-node 8 python diagnosing-errors/tools/preflight.py   # Slurm, no torchrun

Every rank joins (with a timeout), reports host, device and versions, all-reduces a
tensor whose correct sum it knows, and enters a barrier. Rank 0 prints one line per
host, then PREFLIGHT OK; any rank that finds a problem prints PREFLIGHT FAILED and why.
Exit code 0 or 1, so a job script can run it first: `srun ... preflight.py && srun ... train.py`.
"""
import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

HOST = socket.gethostname()


def fail(rank, msg):
    print(f"PREFLIGHT FAILED (rank {rank} on {HOST}): {msg}", flush=True)
    sys.exit(1)


def free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def dist_env():
    """(rank, world_size, local_rank) from torchrun, Slurm, or neither; sets MASTER_ADDR/PORT for env://."""
    env = os.environ
    if "RANK" in env:  # torchrun, or set by hand
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
    if int(env.get("SLURM_STEP_NUM_TASKS", 1)) > 1:  # srun's tasks; a batch script's shell is one process
        if "MASTER_ADDR" not in env:
            # NOTE: the first host of the allocation is rank 0's host under srun's default block distribution
            out = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                                 capture_output=True, text=True, check=True).stdout
            env["MASTER_ADDR"] = out.split()[0]
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))  # one port per job
        return int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"])
    env.setdefault("MASTER_ADDR", "localhost")
    env.setdefault("MASTER_PORT", str(free_port()))
    return 0, 1, 0


def pick_device(rank, local_rank):
    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    n = torch.cuda.device_count()
    if n > 1 and local_rank >= n:
        fail(rank, f"local rank {local_rank} but only {n} GPUs visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')})")
    device = torch.device("cuda", local_rank if n > 1 else 0)  # one visible GPU per task (srun --gpus-per-task=1)
    torch.cuda.set_device(device)
    return device, "nccl"


def describe(rank, local_rank, device):
    cuda = device.type == "cuda"
    return {
        "host": HOST, "rank": rank, "local_rank": local_rank,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "uuid": str(torch.cuda.get_device_properties(device).uuid) if cuda else f"cpu-{rank}",
        "versions": f"torch {torch.__version__}  cuda {torch.version.cuda or '-'}  "
                    f"nccl {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else '-'}",
    }


def check_all_reduce(rank, world, device, megabytes):
    x = torch.full((int(megabytes * 2**20) // 4,), float(rank + 1), device=device)
    dist.all_reduce(x)  # warm-up: NCCL sets up its connections on the first call
    x.fill_(rank + 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    correct = bool((x == world * (world + 1) / 2).all())
    busbw = 2 * (world - 1) / world * x.numel() * 4 / seconds / 1e9  # what nccl-tests calls bus bandwidth
    return correct, seconds, busbw


def summary(infos):
    by_host = defaultdict(list)
    for info in infos:
        by_host[info["host"]].append(info)
    for host, infos_ in by_host.items():
        ranks = sorted(i["rank"] for i in infos_)
        span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else ",".join(map(str, ranks))
        names = sorted({i["device"] for i in infos_})
        print(f"preflight: {host}  ranks {span}  {len(infos_)}x {'/'.join(names)}  "
              f"{infos_[0]['versions']}", flush=True)
    problems = []
    versions = {i["versions"] for i in infos}
    if len(versions) > 1:
        problems.append("different versions across ranks: " + " | ".join(sorted(versions)))
    seen = {}
    for i in infos:
        other = seen.setdefault((i["host"], i["uuid"]), i["rank"])
        if other != i["rank"]:
            problems.append(f"ranks {other} and {i['rank']} share one GPU on {i['host']} (torch.cuda.set_device missing?)")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for every rank, and for each collective")
    parser.add_argument("--mb", type=float, default=4, help="all-reduce size in MB (try 1024 on GPUs for a bandwidth check)")
    args = parser.parse_args()

    rank, world, local_rank = dist_env()
    device, backend = pick_device(rank, local_rank)
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout),
                                device_id=device if device.type == "cuda" else None)
    except Exception as e:  # NOTE: rank 0 says how many joined; the others can only say they found nobody
        first_line = str(e).strip().splitlines()[0].rstrip(".")
        fail(rank, f"could not form the group of {world} ranks at {where} within {args.timeout:g} s: {first_line}. "
                   "Did every rank start? Can this host reach MASTER_ADDR:MASTER_PORT (firewall, wrong interface)?")

    correct, seconds, busbw = check_all_reduce(rank, world, device, args.mb)
    dist.barrier()
    infos = [None] * world
    dist.all_gather_object(infos, dict(describe(rank, local_rank, device), correct=correct))
    if rank == 0:
        problems = summary(infos)
        wrong = [i["rank"] for i in infos if not i["correct"]]
        if wrong:
            problems.append(f"all-reduce returned wrong values on ranks {wrong}")
        if problems:
            fail(rank, "; ".join(problems))
        print(f"PREFLIGHT OK: {world} rank(s) on {len({i['host'] for i in infos})} host(s), {backend}; "
              f"all-reduce of {args.mb:g} MB correct in {seconds * 1e3:.1f} ms (busbw {busbw:.2f} GB/s); barrier ok",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
