"""Runs a chapter's script (the first argument, with the rest as its arguments) as __main__, and prints, as it
ends, one line `counts: {...}` with what the run did that its log does not show:

- "mlp_forwards": how many times the decoder layers' MLPs ran forward to train (with gradients on: chapter 05's
  evaluations are left out); activation checkpointing runs each twice a micro-step (once more in backward), so twice
  as often as without it (counted in runs without --compile only);
- "unique_graphs" and "graph_breaks": the graphs dynamo compiled, and the breaks in them (torch.compile).
"""

import json
import os
import runpy
import sys

import torch
from transformers.models.llama import modeling_llama



def counting(forward, counts):
    """forward, counting its calls in counts["mlp_forwards"].

    NOTE: a closure, not globals: dynamo looks a global up in its module by name, and runpy has put the chapter's
    script in the place of this module, __main__.
    """
    def counting_forward(self, *args, **kwargs):
        counts["mlp_forwards"] += torch.is_grad_enabled()
        return forward(self, *args, **kwargs)

    return counting_forward


counts = {"mlp_forwards": 0}
# NOTE: not in a compiled run: a side effect inside a checkpointed layer stops dynamo from compiling that layer.
if "--compile" not in sys.argv:
    modeling_llama.LlamaMLP.forward = counting(modeling_llama.LlamaMLP.forward, counts)
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    from torch._dynamo.utils import counters

    counts.update(unique_graphs=counters["stats"]["unique_graphs"],
                  graph_breaks=sum(counters["graph_break"].values()))
    # NOTE: one write: the ranks share torchrun's stdout, and print() writes the line and its end apart.
    sys.stdout.write(f"[rank {os.environ.get('RANK', 0)}] counts: {json.dumps(counts)}\n")
    sys.stdout.flush()
