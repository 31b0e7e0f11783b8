"""How long does one AdamW step take on the CPU, with and without the fused kernel?

With --cpu-offload (chapters 04 and 05) AdamW steps on the CPU, over this rank's shards of every parameter. This
tool times optimizer.step() over tensors of a model's parameter shapes (the tiny bundled model by default), with the
per-parameter loop (fused=False, what torch picks on the CPU by default), foreach=True and fused=True.

    python dev/benchmark_adamw.py
    python dev/benchmark_adamw.py -m meta-llama/Llama-3.2-1B --shards 8     # one rank's shards of 8
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
    parser.add_argument("--steps", type=int, default=30, help="steps measured, after 3 warm-up steps")
    args = parser.parse_args()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model_name))
    shapes = [(-(-p.shape[0] // args.shards), *p.shape[1:]) for p in model.parameters()]
    results = {"parameters": sum(torch.Size(shape).numel() for shape in shapes), "tensors": len(shapes),
               "threads": torch.get_num_threads()}
    for name, seconds in step_seconds(shapes, args.steps).items():
        results[f"{name}_step_ms"] = seconds * 1e3
    print(json.dumps(results))


def step_seconds(shapes, steps):
    """{variant: seconds of its fastest AdamW step} (the chapters' hyperparameters, fp32 CPU tensors).

    NOTE: the variants take turns, step by step, and each keeps its fastest step: on a shared machine the others
    measure the neighbours too, and taking turns exposes every variant to the same neighbours.
    """
    generator = torch.Generator().manual_seed(0)
    optimizers = {}
    for name, options in VARIANTS.items():
        params = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizers[name] = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **options)
    fastest = {name: float("inf") for name in VARIANTS}
    for step in range(3 + steps):
        for name, optimizer in optimizers.items():
            started = time.perf_counter()
            optimizer.step()
            if step >= 3:
                fastest[name] = min(fastest[name], time.perf_counter() - started)
    return fastest


if __name__ == "__main__":
    main()
