"""Collective mismatch: one rank calls an extra all-reduce.

Every rank trains on its own shard of 10 samples. With 2 ranks the shards are
5 + 5 and all is well; with 3 ranks they are 4 + 3 + 3, so rank 0 runs one more
step than the others. Its gradient all-reduce waits for partners that already
sit in the barrier after the loop. "Fine on 8 GPUs, hangs on 64" is often this.

Hang, then look at it from a second terminal:
    torchrun --standalone --nproc-per-node 3 diagnosing-errors/broken/extra_allreduce.py
    python diagnosing-errors/tools/dump_hang.py
  -> rank 0 (the odd one out) waits in train() at dist.all_reduce(p.grad);
     ranks 1-2 wait in main() at dist.barrier()

Let the timeout fire and read the flight recorder:
    TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=outputs/fr/rank_ torchrun --standalone --nproc-per-node 3 diagnosing-errors/broken/extra_allreduce.py --timeout 5
    torchfrtrace outputs/fr
  -> Collective sequence number: 8 has errors ... COLLECTIVE_TYPE_MISMATCH,
     Expected collective type: 'all_reduce' does not match found collective type: 'barrier'

Fix (--fix): agree on the number of steps before the loop.
"""
import argparse
import datetime
import os
import pickle

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def dump_flight_recorder():
    # NOTE: with NCCL, TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes this file by itself.
    # Gloo records the same entries but never dumps them, so we do it on error.
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
    if not prefix or int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0")) <= 0:
        return
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    # Gloo leaves the group's name empty in pg_config (torch 2.13), and
    # torchfrtrace looks groups up by name: fill it in from the entries.
    ranks = next(iter(trace["pg_config"].values()))["ranks"]
    trace["pg_config"] = {e["process_group"][0]: {"name": e["process_group"][0], "desc": e["process_group"][1],
                                                 "ranks": ranks} for e in trace["entries"]}
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(f"{prefix}{dist.get_rank()}", "wb") as f:
        pickle.dump(trace, f)


def train(model, opt, shard, world):
    for x in shard:
        loss = (model(x[:-1]) - x[-1:]).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # the extra step's all-reduce has no partner
            p.grad /= world
        opt.step()
        opt.zero_grad()


@record  # NOTE: without it torchrun's summary says "traceback: To enable traceback see ..."
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60, help="process-group timeout, seconds")
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # same data and model on every rank
    data = torch.randn(10, 9)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = data[rank::world]  # NOTE: DistributedSampler pads shards to equal length; hand-made or streaming shards don't
    if args.fix:
        steps = torch.tensor(len(shard))
        dist.all_reduce(steps, op=dist.ReduceOp.MIN)
        shard = shard[:steps]

    try:
        train(model, opt, shard, world)
        print(f"rank {rank}: {len(shard)} steps done", flush=True)
        dist.barrier()  # everyone done before rank 0 saves
    except RuntimeError:
        dump_flight_recorder()
        raise
    if rank == 0:
        print("training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
