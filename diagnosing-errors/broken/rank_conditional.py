"""Rank-conditional code that deadlocks.

Only rank 0 saves the checkpoint, and the save function ends in a barrier
("nobody reads the file before it is complete"). Ranks 1..N-1 never enter that
branch, so they go on to the next step's gradient all-reduce while rank 0
waits in the barrier. Each side waits for the other, forever (or until the
process-group timeout).

Hang, then look at it from a second terminal:
    torchrun --standalone --nproc-per-node 3 diagnosing-errors/broken/rank_conditional.py
    python diagnosing-errors/tools/dump_hang.py
  -> rank 0 (the odd one out) waits in save_checkpoint() at dist.barrier(),
     called from train(); ranks 1-2 wait in train() at dist.all_reduce(p.grad)

The stack says why rank 0 is there: save_checkpoint <- train, under "if rank == 0".
Fix (--fix): every rank calls save_checkpoint(); only the file write is rank 0's.
"""
import argparse
import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def save_checkpoint(model, step, out_dir):
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(out_dir, f"step{step}.pt"))
    dist.barrier()  # NOTE: a collective: every rank must reach this line


def train(model, opt, data, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    for step, x in enumerate(data):
        loss = (model(x[:-1]) - x[-1:]).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        if step % 5 == 4 and (args.fix or rank == 0):  # the bug: "rank == 0" hides a collective
            save_checkpoint(model, step, args.out)


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=60, help="process-group timeout, seconds")
    parser.add_argument("--out", default="outputs/rank_conditional")
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(10, 9)  # toy: every rank sees the same 10 samples
    train(model, opt, data, args)
    print(f"rank {dist.get_rank()}: training finished", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
