"""A NaN that appears mid-training.

One record of rank 1's data is corrupt (a value of 1e25: wrong units, garbage
bytes). Its squared error overflows float32 to inf at step 37, the gradient
all-reduce carries inf/NaN to every rank, and from step 38 on every rank's
weights and loss are NaN. Rank 0 logs every 5 steps, so the log first shows
nan at step 40, on the wrong rank, three steps late.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/nan_midway.py
  -> step 35 loss 0.9... / step 40 loss nan

Find the first bad step, rank and module:
    torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/nan_watch.py diagnosing-errors/broken/nan_midway.py
  -> nan_watch: rank 1, step 37: first non-finite value is the output of MSELoss;
     its inputs are finite but as large as 8e+25: look at this step's batch
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def batches(rank, steps, seed=0):
    g = torch.Generator().manual_seed(seed + rank)
    for step in range(steps):
        x = torch.randn(16, 8, generator=g)
        if rank == 1 and step == 37:
            x[3] = 1e25  # the corrupt record
        yield step, x, x.sum(dim=1, keepdim=True)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    loss_fn = torch.nn.MSELoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, x, y in batches(rank, steps=50):
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduces (averages) the gradients here: one rank's inf reaches every rank
        opt.step()
        opt.zero_grad()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    # NOTE: the DDP reducer goes first: at main()'s return it would destroy the group holding the GIL that a gloo
    # thread freeing the last all-reduce waits for, a hang (torch 2.13; pytorch #56297).
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
