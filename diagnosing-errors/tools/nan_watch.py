"""Run a training script and stop at the first non-finite value: which rank, which step, which module.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/tools/nan_watch.py TRAIN.py [ARGS...]

No change to the script: global hooks check the output of every nn.Module
forward, every gradient before optimizer.step() and every parameter after it.
"Step" counts optimizer.step() calls (the first step is 0). The first rank to
fail raises FloatingPointError; torchrun's summary shows its message, and the
other ranks fail right after (their all-reduce lost a partner).

NOTE: each check is a .item() sync, so this is slow: a debugging run, not a production flag.
For NaNs that start in backward, torch.autograd.set_detect_anomaly(True) names the op.
"""
import os
import runpy
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

step = 0
names = {}  # module or parameter -> qualified name, from the outermost module that owns it


def tensors(x):
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in tensors(item)]
    if isinstance(x, dict):
        return tensors(list(x.values()))
    return []


def finite(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts)


def fail(what):
    msg = f"nan_watch: rank {os.environ.get('RANK', 0)}, step {step}: {what}"
    print(msg, file=sys.stderr, flush=True)
    raise FloatingPointError(msg)


def name_modules(module, args):
    if module not in names:  # NOTE: the outermost module runs first, so children get their full dotted names
        for n, m in module.named_modules():
            names.setdefault(m, n or type(m).__name__)
        for n, p in module.named_parameters():
            names.setdefault(p, n)


def check_output(module, args, output):
    if finite(tensors(output)):
        return
    inputs = tensors(args)
    if not finite(inputs):
        fail(f"the input of {names[module]} ({type(module).__name__}) is already non-finite: bad data, "
             "or a plain torch op (not a module) before it")
    biggest = max((t.abs().max().item() for t in inputs if t.numel()), default=0.0)
    fail(f"first non-finite value is the output of {names[module]}; its inputs are finite "
         f"but as large as {biggest:.2g}: look at this step's batch")


def check_grads(opt, args, kwargs):
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None and not finite([p.grad]):
                fail(f"gradient of {names.get(p, tuple(p.shape))} is non-finite but the forward was finite: "
                     "backward overflowed here, or the gradient all-reduce brought it from another rank")


def check_params(opt, args, kwargs):
    global step
    for group in opt.param_groups:
        for p in group["params"]:
            if not finite([p]):
                fail(f"optimizer.step() made {names.get(p, tuple(p.shape))} non-finite (learning rate? huge gradient?)")
    step += 1


@record
def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    register_module_forward_pre_hook(name_modules)
    register_module_forward_hook(check_output)
    register_optimizer_step_pre_hook(check_grads)
    register_optimizer_step_post_hook(check_params)
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
