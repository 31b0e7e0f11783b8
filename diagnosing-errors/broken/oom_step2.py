"""Out of memory at step 2 (needs a CUDA GPU).

Step 1 fits: weights + activations + gradients. At the end of step 1 AdamW
creates its state, two fp32 copies of every weight, which stay for good. Step 2
then needs weights + optimizer state + activations + gradients at once, and runs
out. The GPU is capped at --budget-gb so that the numbers are the same on any GPU.

    python diagnosing-errors/broken/oom_step2.py
  -> step 1: peak ~3 GiB of 4 GiB, optimizer state now 1.2 GiB
     step 2: out of memory with ~3.5 GiB allocated, 1.2 GiB of it optimizer state
     snapshot: outputs/oom_snapshot.pickle (drag it into https://pytorch.org/memory_viz)

In the snapshot's timeline the two AdamW state tensors appear at the end of
step 1 and never leave. Fixes: size a job by the peak of step 2, not step 1;
smaller micro-batches with gradient accumulation; activation checkpointing; a
sharded optimizer (ZeRO / FSDP); bf16 optimizer state.
"""
import argparse
import os
import sys

import torch

GiB = 2**30


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-gb", type=float, default=4)
    parser.add_argument("--snapshot", default="outputs/oom_snapshot.pickle")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("oom_step2.py needs a CUDA GPU")
    budget = args.budget_gb * GiB
    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)

    # Sizes from the budget: weights 15%; optimizer state 2x weights; 5 live [batch, d]
    # activations/grads at the backward peak, 50%. Step 1: ~80%. Step 2: ~110%.
    d = int((0.15 * budget / 8) ** 0.5)
    batch = int(0.5 * budget / (5 * 4 * d))
    model = torch.nn.Sequential(torch.nn.Linear(d, d, bias=False), torch.nn.ReLU(), torch.nn.Linear(d, d, bias=False)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    torch.cuda.memory._record_memory_history(max_entries=100_000)  # NOTE: records a stack per allocation
    for step in range(1, 4):
        try:
            x = torch.randn(batch, d, device="cuda")
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        except torch.OutOfMemoryError:
            print(f"step {step}: out of memory with {torch.cuda.memory_allocated() / GiB:.1f} GiB allocated, "
                  f"{state_bytes(opt) / GiB:.1f} GiB of it optimizer state", flush=True)
            os.makedirs(os.path.dirname(args.snapshot) or ".", exist_ok=True)
            torch.cuda.memory._dump_snapshot(args.snapshot)
            print(f"snapshot: {args.snapshot} (drag it into https://pytorch.org/memory_viz)", flush=True)
            raise
        print(f"step {step}: peak {torch.cuda.max_memory_allocated() / GiB:.1f} GiB of {args.budget_gb:g} GiB, "
              f"optimizer state now {state_bytes(opt) / GiB:.1f} GiB", flush=True)
        torch.cuda.reset_peak_memory_stats()


if __name__ == "__main__":
    main()
