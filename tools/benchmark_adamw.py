"""How long does one AdamW step take on the CPU, with and without the fused kernel?

With --cpu-offload (chapters 04 and 05) AdamW steps on the CPU, over this rank's shards of every parameter. This
tool times optimizer.step() over tensors of a model's parameter shapes (the tiny bundled model by default), with the
per-parameter loop (fused=False, what torch picks on the CPU by default), foreach=True and fused=True.

    python tools/benchmark_adamw.py
    python tools/benchmark_adamw.py -m meta-llama/Llama-3.2-1B --shards 8     # one rank's shards of 8
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model-name", default=str(REPO_ROOT / "data" / "tiny-llama"))
    parser.add_argument("--shards", type=int, default=1, help="time 1/SHARDS of every parameter, as one FSDP rank")
    parser.add_argument("--steps", type=int, default=20, help="steps measured, after 3 warm-up steps")
    args = parser.parse_args()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_name))
    shapes = [(-(-p.shape[0] // args.shards), *p.shape[1:]) for p in model.parameters()]
    results = {"parameters": sum(torch.Size(shape).numel() for shape in shapes), "tensors": len(shapes),
               "threads": torch.get_num_threads()}
    for name, options in VARIANTS.items():
        results[f"{name}_step_ms"] = step_seconds(shapes, options, args.steps) * 1e3
    print(json.dumps(results))


def step_seconds(shapes, options, steps):
    """The median seconds of one AdamW step (the chapters' hyperparameters) over fresh fp32 CPU tensors."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **options)
    times = []
    for step in range(3 + steps):
        started = time.perf_counter()
        optimizer.step()
        if step >= 3:
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
