"""Mismatched tensor shapes across ranks.

Each rank counts the labels in its own shard and all-reduces the counts to get
a global histogram. torch.bincount's length is max(label) + 1 of the labels it
saw, so a rank that never saw the last class sends a shorter tensor.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/shape_mismatch.py
  -> gloo aborts one rank: "op.preamble.length <= op.nbytes. 16 vs 8 ... Is there a
     distributed collective mismatch in your code?" (NCCL may hang, or silently
     read past the shorter buffer)

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/shape_mismatch.py
  -> RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running
     collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[5], ...),
     but Rank 1 is running collective: CollectiveFingerPrint(..., TensorShape=[4], ...)

Fix (--fix): torch.bincount(labels, minlength=NUM_CLASSES).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

NUM_CLASSES = 5


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    labels = torch.tensor([0, 1, 2, 3, 4, 1, 2, 3, 0, 1, 2, 3])  # class 4 appears once, in rank 0's shard
    mine = labels[rank::world]
    counts = torch.bincount(mine, minlength=NUM_CLASSES if args.fix else 0)
    print(f"rank {rank}: local label counts {counts.tolist()}", flush=True)
    dist.all_reduce(counts)
    if rank == 0:
        print(f"global label counts {counts.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
