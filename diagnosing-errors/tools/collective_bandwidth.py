"""Collective bandwidth between the ranks of a job, as nccl-tests reports it: run it on the nodes before a long job.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/collective_bandwidth.py --max-bytes 1M   # CPU
    torchrun --standalone --nproc-per-node 8 diagnosing-errors/tools/collective_bandwidth.py                  # a node
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        diagnosing-errors/tools/collective_bandwidth.py --ops all_reduce                                     # 2 nodes

For each collective and each size from --min-bytes to --max-bytes (doubling), every rank runs --warmup then --iters
calls; a call's time is the slowest rank's mean. Rank 0 prints, per size, the time, the algorithm bandwidth
(bytes / time) and the bus bandwidth, nccl-tests' figure that compares with the link's speed whatever the number of
ranks n: algorithm bandwidth x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all
(bytes: the gathered output, the scattered input, the exchanged buffer), x 1 for send_recv (each rank sends its
buffer to the next rank of a ring and receives the previous one's). NCCL on GPUs (bf16), gloo on CPUs (fp32).
"""

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

# NOTE: torch 2.13's names; torch 2.11 has only the older ones.
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# nccl-tests' bus bandwidth factors (PERFORMANCE.md), a function of the number of ranks.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", choices=list(BUS_FACTORS), default=list(BUS_FACTORS))
    parser.add_argument("--min-bytes", type=parse_bytes, default="1K", help="the smallest buffer (K, M, G: 1024s)")
    parser.add_argument("--max-bytes", type=parse_bytes, help="the largest buffer (default: 1G on GPUs, 16M on CPUs)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per size")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size first")
    parser.add_argument("--json", action="store_true", help="print one JSON list of the rows, for jq")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("error: no RANK in the environment; start it with torchrun (see --help)")
    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    world_size, dtype = dist.get_world_size(), torch.bfloat16 if cuda else torch.float32
    if args.max_bytes is None:
        args.max_bytes = parse_bytes("1G" if cuda else "16M")
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.iters < 1 or args.warmup < 0:
        raise SystemExit("error: need 1 <= --min-bytes <= --max-bytes, --iters >= 1 and --warmup >= 0")
    rows = []
    for op in args.ops:
        size = args.min_bytes
        while size <= args.max_bytes:
            rows.append(measure(op, size, args.iters, args.warmup, world_size, dtype, device))
            size *= 2
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            print(f"{world_size} ranks, {dtype}, {'NCCL' if cuda else 'gloo'}; bandwidths in GB/s (1e9 bytes)")
            print(f"{'op':<15}{'bytes':>14}{'time (us)':>14}{'algbw':>10}{'busbw':>10}")
            for row in rows:
                print(f"{row['op']:<15}{row['bytes']:>14,}{row['seconds'] * 1e6:>14.1f}{row['algbw_gbps']:>10.3f}"
                      f"{row['busbw_gbps']:>10.3f}")
    dist.destroy_process_group()


def measure(op, size, iters, warmup, world_size, dtype, device):
    """One row: the slowest rank's mean time of one call on a buffer of about size bytes, and its bandwidths."""
    element_size = torch.empty((), dtype=dtype).element_size()
    # NOTE: a multiple of the ranks, so that all_gather, reduce_scatter and all_to_all split it evenly.
    numel = max(world_size, size // element_size // world_size * world_size)
    full = torch.ones(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // world_size, dtype=dtype, device=device)
    received = torch.empty_like(full)
    rank = dist.get_rank()

    def call():
        if op == "all_reduce":
            dist.all_reduce(full)
        elif op == "all_gather":
            all_gather(received, shard)
        elif op == "reduce_scatter":
            reduce_scatter(shard, full)
        elif op == "all_to_all":
            dist.all_to_all_single(received, full)
        else:
            requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, full, (rank + 1) % world_size),
                                               dist.P2POp(dist.irecv, received, (rank - 1) % world_size)])
            for request in requests:
                request.wait()

    for _ in range(warmup):
        call()
    synchronize(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(device)
    seconds = torch.tensor((time.perf_counter() - started) / iters, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    nbytes = numel * element_size
    algbw = nbytes / seconds.item() / 1e9
    return {"op": op, "bytes": nbytes, "seconds": seconds.item(), "algbw_gbps": algbw,
            "busbw_gbps": algbw * BUS_FACTORS[op](world_size)}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parse_bytes(text):
    units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    text = str(text).strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}; give bytes, or a number with K, M or G")


if __name__ == "__main__":
    main()
