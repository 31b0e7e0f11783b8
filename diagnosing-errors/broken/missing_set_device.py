"""All ranks on GPU 0 because torch.cuda.set_device is missing (needs 2 GPUs on one node).

"cuda" means the current device, and the current device is cuda:0 until
set_device says otherwise, so every rank allocates on GPU 0.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/missing_set_device.py
  -> rank 0: local rank 0 on cuda:0 / rank 1: local rank 1 on cuda:0
     then NCCL refuses: "... Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."
     nvidia-smi (while it runs): both python processes listed under GPU 0, none under GPU 1.
     Without a collective (or with gloo) nothing fails: both ranks just share one GPU's memory and time.

Fix (--fix): torch.cuda.set_device(local_rank) before any CUDA work, and
init_process_group(device_id=...) so the NCCL communicator is bound to it at once.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("missing_set_device.py needs 2 CUDA GPUs")
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.fix:
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("nccl")
    x = torch.ones(1 << 20, device="cuda")
    print(f"rank {dist.get_rank()}: local rank {local_rank} on {x.device}", flush=True)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {dist.get_rank()}: all-reduce ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
