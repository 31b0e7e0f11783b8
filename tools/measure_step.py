"""Run a chapter's training script and measure, on every rank and for every training step, what it communicates
and what memory it holds, without a line of measuring code in the chapter.

    torchrun --standalone --nproc-per-node 2 tools/measure_step.py --out outputs/measured-ddp \\
        02-distributed-data-parallel/train_llm.py --max-steps 2 -e measured-ddp
    python tools/measure_step.py --summary outputs/measured-ddp

Everything after the script's path goes to the script. Each rank writes OUT/rank-<rank>.json:

* "steps": per training step (from the first forward pass after an optimizer step to the end of the next
  optimizer step), for every kind of collective and process group: the calls, the bytes of the buffers, and the
  bytes this rank sends (below). Collectives between steps (the logged loss, checkpoints) are counted apart,
  in "between_steps".
* "memory_held": after the first optimizer step, the bytes of this rank's parameters, gradients and optimizer
  state: the local shards of DTensors, the optimizer's state tensors (not its 0-dimensional step counters).
* "peak_live_bytes_above_start": per step, the most bytes of tensor storage alive at once during forward and
  backward, minus what was alive when the step's forward began: activations, the gathered FSDP layers and every
  temporary buffer (the CPU has no allocator statistics; this counts the storages of every tensor an operator
  returns).
* "peak_full_size_grad_bytes": per step, the most bytes of full-size (unsharded) gradients alive at once: FSDP's
  unsharded gradients (an FSDPParam's unsharded_accumulated_grad and its _unsharded_param.grad, before they are
  reduce-scattered into the shard's gradient), plus the .grad of every parameter that is a plain tensor (DDP's, one
  GPU's); the shards' gradients and DTensor parameters' are left out. Gradients arrive in autograd and leave only in
  an FSDP group's post_backward() (or zero_grad()), so it is sampled exactly at the start of every post_backward()
  and of the optimizer step, each gradient counted once.

* "seconds": per step, the host's wall time from its first forward pass to the end of its optimizer step (on a GPU,
  the time the host took to queue the step's work, which runs ahead of the GPU but for a step's host syncs).
* "host_syncs": per step, {"OPERATOR at FILE:LINE": calls} for every operator that makes the host wait for the
  device: aten._local_scalar_dense (.item(), bool(tensor), `if tensor:`), aten.is_nonzero, aten.equal, aten.nonzero,
  aten.unique*, aten.masked_select, aten.repeat_interleave without output_size, copies to the CPU from another
  device, and Tensor.tolist (which dispatches no operator: it is patched). FILE:LINE is the first Python frame
  outside torch (and this tool): where the chapter or transformers asked for the value. Syncs between steps (the
  logged loss) are in "host_syncs_between_steps".
* "blocking_host_collectives": per step, {"FUNCTION at FILE:LINE": calls} for every collective the script itself
  calls that makes its host wait for the other ranks' hosts: a torch.distributed call without async_op=True on a
  group made with backend="gloo" (on a GPU, NCCL's collectives make the GPU wait, not the host), barrier() and the
  *_object collectives on any group. A step's span here runs to the next step's first forward pass: what the
  script does after its optimizer step (the stop agreement, the logged loss) counts in the step it follows.
* "matmuls": per step, {"OPERATOR(input dtypes)": calls} for every mm, bmm, addmm, baddbmm, addbmm, linear,
  grouped mm (the experts of chapter 10) and scaled-dot-product-attention operator (forward and backward, every
  aten variant), with the dtypes of its tensor inputs: what precision each matrix multiplication runs in.

How it works: a TorchDispatchMode sees every operator, including the c10d collectives that DDP's C++ reducer and
FSDP issue and the functional collectives DTensor issues; a global optimizer hook marks the end of each step.

"Bytes sent" by one rank, per collective of an N-rank group on a buffer of S bytes, is what that rank puts on the
wire in NCCL's ring algorithms (the "bus bandwidth" convention of nccl-tests); the time a collective takes at a
link bandwidth B is about bytes sent / B:

    all-reduce       2 (N-1)/N x S     (a ring reduce-scatter, then a ring all-gather)
    all-gather       (N-1)/N x S       S: the gathered output (each rank's input is S/N)
    reduce-scatter   (N-1)/N x S       S: the full input (each rank's output is S/N)
    broadcast        (N-1)/N x S       averaged over the ranks: in a chain every rank but the last forwards S
    reduce           (N-1)/N x S       the same, the other way
    all-to-all       (N-1)/N x S       each rank keeps 1/N of its own buffer; with uneven split sizes (chapter
                                       10's tokens), S minus the chunk this rank sends to itself, exactly
    send             S                 (recv: 0 sent)
"""

import argparse
import atexit
import json
import os
import runpy
import sys
import time
import weakref
from collections import defaultdict
from pathlib import Path

# NOTE: how many of a collective's buffer bytes one rank sends, as a function of the group size n.
SENT_FRACTION = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
}


def bytes_sent(kind, buffer_bytes, group_size):
    """The bytes one rank sends in a collective of this kind on a buffer of buffer_bytes (see the docstring)."""
    if group_size <= 1:
        return 0.0
    return SENT_FRACTION[kind](group_size) * buffer_bytes


def main():
    parser = argparse.ArgumentParser(
        description="Run a training script and count, per training step and rank, the bytes sent in each kind of "
                    "collective and the memory held (see the module's docstring for the definitions).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        usage="%(prog)s --out DIR SCRIPT [SCRIPT ARGUMENTS ...]  |  %(prog)s --summary DIR",
    )
    parser.add_argument("--out", help="folder for one rank-<rank>.json per rank")
    parser.add_argument("--log-calls", action="store_true",
                        help="also record every collective and host sync of every step, in order (operator, group or "
                             "place, buffer bytes)")
    parser.add_argument("--summary", metavar="DIR", help="print a table of the measurements in DIR and exit")
    parser.add_argument("script", nargs="?", help="the training script, e.g. 02-distributed-data-parallel/train_llm.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = parser.parse_args()
    if args.summary:
        print_summary(read_measurements(args.summary))
        return
    if not args.out or not args.script:
        parser.error("give --out DIR and the script to run (or --summary DIR)")
    script = Path(args.script)
    if not script.is_file():
        raise SystemExit(f"error: no script {script}; give the path of a chapter's train_llm.py")
    meter = StepMeter(Path(args.out), log_calls=args.log_calls)
    meter.start()
    sys.argv = [str(script), *args.script_args]
    sys.path[0] = str(script.resolve().parent)
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        meter.stop()


def read_measurements(out_dir):
    """{rank: measurement} from the rank-*.json files of a measured run."""
    files = sorted(Path(out_dir).glob("rank-*.json"))
    if not files:
        raise SystemExit(f"error: no rank-*.json in {out_dir}; run a script under tools/measure_step.py --out first")
    return {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in files}


def print_summary(measurements):
    for rank, measurement in sorted(measurements.items()):
        held = measurement["memory_held"]
        print(f"rank {rank} of {measurement['world_size']}: held after the first step: "
              + ", ".join(f"{name} {value / 1e6:.3f} MB" for name, value in held.items()))
        for step in measurement["steps"]:
            peak = step["peak_live_bytes_above_start"]
            print(f"  step {step['step']}: peak of live tensors above the step's start {peak / 1e6:.2f} MB")
            for key, counts in sorted(step["collectives"].items()):
                print(f"    {key:40s} {counts['calls']:5d} calls, buffers {counts['buffer_bytes'] / 1e6:10.3f} MB, "
                      f"sent {counts['sent_bytes'] / 1e6:10.3f} MB")


# ---------------------------------------------------------------------------------------------------------------------
# The meter


class StepMeter:
    """Counts collectives and live tensor bytes per training step, in one process."""

    def __init__(self, out_dir, log_calls=False):
        self.out_dir = out_dir
        self.log_calls = log_calls
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.steps = []
        self.between_steps = defaultdict(lambda: {"calls": 0, "buffer_bytes": 0, "sent_bytes": 0.0})
        self.host_syncs_between_steps = defaultdict(int)
        self.current = None
        self.memory_held = None
        self.optimizers_seen = weakref.WeakSet()
        self.optimizer_depth = 0
        self.live_storages = {}
        self.live_bytes = 0
        self.mode = None
        self.hooks = []
        self.modules_seen = weakref.WeakSet()
        self.grad_holders = []  # weak references to FSDPParams and plain parameters, whose gradients are full-size

    def start(self):
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.hooks = [register_module_forward_pre_hook(self.on_forward),
                      register_optimizer_step_pre_hook(self.on_optimizer_step_begin),
                      register_optimizer_step_post_hook(self.on_optimizer_step_end)]
        self.patch_storage_resize(torch)
        self.patch_tolist(torch)
        self.patch_fsdp_post_backward()
        self.patch_host_collectives()
        self.mode = make_dispatch_mode(self)
        self.mode.__enter__()
        atexit.register(self.write)

    def stop(self):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        for hook in self.hooks:
            hook.remove()
        self.write()

    # Step boundaries

    def on_forward(self, module, inputs):
        if module not in self.modules_seen:
            self.modules_seen.add(module)
            self.track_grad_holders(module)
        if self.current is None and self.optimizer_depth == 0:
            self.current = {"step": len(self.steps) + 1, "collectives": defaultdict(
                lambda: {"calls": 0, "buffer_bytes": 0, "sent_bytes": 0.0}),
                "live_bytes_at_start": self.live_bytes, "peak_live_bytes": self.live_bytes,
                "in_forward_backward": True, "host_syncs": defaultdict(int), "matmuls": defaultdict(int),
                "peak_full_size_grad_bytes": 0, "started": time.perf_counter(),
                "blocking_host_collectives": defaultdict(int)}

    def on_optimizer_step_begin(self, optimizer, args, kwargs):
        if self.optimizer_depth == 0 and self.current is not None:
            self.sample_full_size_grads()
            # NOTE: the forward-backward peak ends where the optimizer starts: on step 1 AdamW allocates its state.
            self.current["peak_live_bytes_above_start"] = self.current["peak_live_bytes"] - self.current["live_bytes_at_start"]
            self.current["in_forward_backward"] = False
        self.optimizer_depth += 1
        self.optimizers_seen.add(optimizer)

    def on_optimizer_step_end(self, optimizer, args, kwargs):
        self.optimizer_depth -= 1
        if self.optimizer_depth > 0:
            return
        if self.memory_held is None:
            self.memory_held = measure_memory_held(self.optimizers_seen)
        if self.current is not None:
            step = self.current
            self.steps.append({"step": step["step"], "collectives": dict(step["collectives"]),
                               "peak_live_bytes_above_start": step.get("peak_live_bytes_above_start", 0),
                               "host_syncs": dict(step["host_syncs"]), "matmuls": dict(step["matmuls"]),
                               "peak_full_size_grad_bytes": step["peak_full_size_grad_bytes"],
                               "seconds": time.perf_counter() - step["started"],
                               "blocking_host_collectives": step["blocking_host_collectives"],
                               **({"calls": step["calls"]} if "calls" in step else {})})
            self.current = None
            self.write()

    # Collectives

    def on_collective(self, kind, buffer_bytes, group_size, group_ranks, op_name="", sent_bytes=None):
        key = f"{kind} over {group_size} ranks [{','.join(map(str, group_ranks))}]"
        if self.log_calls and self.current is not None:
            self.current.setdefault("calls", []).append([op_name, key, buffer_bytes])
        counts = self.current["collectives"][key] if self.current is not None else self.between_steps[key]
        counts["calls"] += 1
        counts["buffer_bytes"] += buffer_bytes
        counts["sent_bytes"] += bytes_sent(kind, buffer_bytes, group_size) if sent_bytes is None else sent_bytes

    # Host synchronizations and matmul precision

    def on_host_sync(self, op_name):
        key = f"{op_name} at {python_location()}"
        if self.log_calls and self.current is not None:
            self.current.setdefault("calls", []).append([op_name, f"host sync at {python_location()}", 0])
        counts = self.current["host_syncs"] if self.current is not None else self.host_syncs_between_steps
        counts[key] += 1

    def on_matmul(self, op_name, dtypes):
        if self.current is not None:
            self.current["matmuls"][f"{op_name}({', '.join(dtypes)})"] += 1

    def on_blocking_host_collective(self, function_name, location):
        if self.current is not None:
            counts = self.current["blocking_host_collectives"]
        elif self.steps:
            counts = self.steps[-1]["blocking_host_collectives"]
        else:
            return
        counts[f"{function_name} at {location}"] += 1

    def patch_host_collectives(self):
        """Wraps torch.distributed's collectives to note the blocking ones the script calls (see the docstring)."""
        import inspect

        import torch.distributed as dist

        host_groups, meter = [], self
        original_new_group = dist.new_group

        def new_group(*args, **kwargs):
            group = original_new_group(*args, **kwargs)
            if inspect.signature(original_new_group).bind(*args, **kwargs).arguments.get("backend") == "gloo":
                host_groups.append(group)
            return group

        def wrap(function):
            signature = inspect.signature(function)

            def collective(*args, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                if (os.sep + "torch" + os.sep) not in caller:
                    arguments = signature.bind(*args, **kwargs).arguments
                    host = (function.__name__ == "barrier" or function.__name__.endswith("_object")
                            or any(arguments.get("group") is group for group in host_groups))
                    if host and not arguments.get("async_op", False):
                        meter.on_blocking_host_collective(function.__name__, python_location())
                return function(*args, **kwargs)

            return collective

        dist.new_group = new_group
        for name in ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
                     "monitored_barrier", "all_gather_object", "broadcast_object_list", "gather_object",
                     "scatter_object_list"]:
            setattr(dist, name, wrap(getattr(dist, name)))

    def patch_tolist(self, torch):
        """Tensor.tolist() reads the values on the host without dispatching an operator."""
        original_tolist = torch.Tensor.tolist
        meter = self

        def tolist(tensor):
            if type(tensor) is torch.Tensor and tensor.device.type != "meta":
                meter.on_host_sync("Tensor.tolist")
            return original_tolist(tensor)

        torch.Tensor.tolist = tolist

    # Full-size gradients

    def track_grad_holders(self, module):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            self.grad_holders += [weakref.ref(p) for group in groups if group is not None for p in group.fsdp_params]
        # NOTE: FSDP's parameters are DTensors here (a global forward pre-hook runs before FSDP's own gathers them).
        self.grad_holders += [weakref.ref(p) for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]

    def sample_full_size_grads(self):
        if self.current is None:
            return
        grads = {}
        for reference in self.grad_holders:
            holder = reference()
            if holder is None:
                continue
            if type(holder).__name__ == "FSDPParam":
                unsharded = getattr(holder, "_unsharded_param", None)
                candidates = [holder.unsharded_accumulated_grad, unsharded.grad if unsharded is not None else None]
            else:
                candidates = [holder.grad]
            for grad in candidates:
                if grad is not None:
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    grads[id(grad)] = local.numel() * local.element_size()
        peak = self.current["peak_full_size_grad_bytes"]
        self.current["peak_full_size_grad_bytes"] = max(peak, sum(grads.values()))

    def patch_fsdp_post_backward(self):
        """Sample the full-size gradients when an FSDP group starts its post-backward, the one place they leave."""
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        original_post_backward = FSDPParamGroup.post_backward
        meter = self

        def post_backward(group, *args, **kwargs):
            meter.sample_full_size_grads()
            return original_post_backward(group, *args, **kwargs)

        FSDPParamGroup.post_backward = post_backward

    # Live tensor bytes

    def on_new_storage(self, storage):
        key = id(storage)
        if key in self.live_storages:
            return
        nbytes = storage.nbytes()
        self.live_storages[key] = nbytes
        self.add_live_bytes(nbytes)
        weakref.finalize(storage, self.on_storage_freed, key)

    def on_storage_freed(self, key):
        self.live_bytes -= self.live_storages.pop(key, 0)

    def on_storage_resized(self, storage, new_nbytes):
        key = id(storage)
        if key in self.live_storages:
            self.add_live_bytes(new_nbytes - self.live_storages[key])
            self.live_storages[key] = new_nbytes

    def add_live_bytes(self, nbytes):
        self.live_bytes += nbytes
        if (self.current is not None and self.current["in_forward_backward"]
                and self.live_bytes > self.current["peak_live_bytes"]):
            self.current["peak_live_bytes"] = self.live_bytes

    def patch_storage_resize(self, torch):
        """FSDP frees and re-allocates its gathered parameters by resizing their storage, outside any operator."""
        original_resize = torch.UntypedStorage.resize_
        meter = self

        def resize_(storage, size):
            result = original_resize(storage, size)
            meter.on_storage_resized(storage, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_

    def write(self):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        measurement = {"rank": self.rank, "world_size": self.world_size, "memory_held": self.memory_held or {},
                       "steps": self.steps, "between_steps": dict(self.between_steps),
                       "host_syncs_between_steps": dict(self.host_syncs_between_steps)}
        temporary = self.out_dir / f".rank-{self.rank}.json.tmp"
        temporary.write_text(json.dumps(measurement, indent=1))
        os.replace(temporary, self.out_dir / f"rank-{self.rank}.json")


def measure_memory_held(optimizers):
    """Bytes of the parameters, gradients and optimizer state this rank holds (local shards of DTensors)."""
    import torch

    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    params, states = {}, {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                params[id(param)] = param
        for state in optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    states[local(value).data_ptr()] = local(value)
    local_params = [local(param) for param in params.values()]
    grads = [local(param.grad) for param in params.values() if param.grad is not None]
    return {"parameters": sum(t.numel() * t.element_size() for t in local_params),
            "gradients": sum(t.numel() * t.element_size() for t in grads),
            "optimizer_state": sum(t.numel() * t.element_size() for t in states.values())}


def make_dispatch_mode(meter):
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    collectives = collective_table()
    # NOTE: these tensor subclasses turn into operators on plain tensors, which then come back to this mode: those
    # are what is computed and sent. Others (FakeTensor, which DTensor uses to propagate shapes) compute nothing.
    desugaring_subclasses = (DTensor, AsyncCollectiveTensor)

    def process_group(arguments):
        group = arguments.get("process_group", arguments.get("group_name"))
        if isinstance(group, str):
            return dist.distributed_c10d._resolve_process_group(group)
        # NOTE: the c10d operators receive the group as a TorchScript object; unbox() gives the Python one.
        return group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, desugaring_subclasses) for t in types):
                return NotImplemented
            output = func(*args, **kwargs)
            if isinstance(func, torch._ops.HigherOrderOperator):
                return output
            if is_host_sync(func, args, kwargs):
                meter.on_host_sync(func._schema.name)
            if func._schema.name in MATMULS or "scaled_dot_product" in func._schema.name:
                meter.on_matmul(func._schema.name, [str(t.dtype).removeprefix("torch.") for t in tree_leaves((args, kwargs))
                                                    if torch.is_tensor(t)])
            spec = collectives.get(func._schema.name)
            if spec is not None:
                kind, measured = spec
                arguments = {**dict(zip((a.name for a in func._schema.arguments), args)), **kwargs}
                buffers = output if measured == "output" else arguments[measured]
                buffer_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(buffers) if torch.is_tensor(t))
                group = process_group(arguments)
                meter.on_collective(kind, buffer_bytes, group.size(), dist.get_process_group_ranks(group),
                                    func._schema.name, uneven_all_to_all_sent_bytes(arguments, measured, group))
            for tensor in tree_leaves(output):
                if type(tensor) is torch.Tensor and tensor.device.type != "meta":
                    meter.on_new_storage(tensor.untyped_storage())
            return output

    return Mode()


MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::linear",
           "aten::_addmm_activation", "aten::matmul", "aten::_grouped_mm", "aten::grouped_mm"}
# NOTE: operators whose output shape, or result, is a value the host must read from the device first.
HOST_SYNCS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero", "aten::masked_select",
              "aten::unique_dim", "aten::_unique", "aten::_unique2", "aten::unique_consecutive",
              "aten::unique_dim_consecutive"}


def is_host_sync(func, args, kwargs):
    """Whether this operator makes the host wait for the device (see "host_syncs" in the module's docstring)."""
    import torch

    name = func._schema.name
    if name == "aten::repeat_interleave":
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("aten::_to_copy", "aten::copy_"):
        source = args[1] if name == "aten::copy_" else args[0]
        target = args[0].device if name == "aten::copy_" else kwargs.get("device")
        return (torch.is_tensor(source) and source.device.type not in ("cpu", "meta") and target is not None
                and torch.device(target).type == "cpu")
    return name in HOST_SYNCS


def uneven_all_to_all_sent_bytes(arguments, measured, group):
    """What an all_to_all_single with split sizes sends: its input less the rows it sends to itself (None: other
    collectives, and even splits, which bytes_sent() counts)."""
    input_splits = arguments.get("input_split_sizes")
    if measured != "input" or not input_splits or "input" not in arguments:
        return None
    tensor = arguments["input"]
    row_bytes = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
    return (tensor.shape[0] - input_splits[group.rank()]) * row_bytes


def python_location():
    """FILE:LINE of the innermost Python frame outside torch and this tool: who asked for the value."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if (os.sep + "torch" + os.sep) not in filename and filename != __file__:
            return f"{Path(filename).parent.name}/{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def collective_table():
    """{operator: (kind, the argument whose bytes are the buffer S of the docstring, or "output")}."""
    return {
        # torch.distributed's own collectives (dist.all_reduce(), DDP's reducer, FSDP, ZeRO).
        "c10d::allreduce_": ("all_reduce", "tensors"),
        "c10d::allreduce_coalesced_": ("all_reduce", "tensors"),
        "c10d::_allgather_base_": ("all_gather", "output_tensor"),
        "c10d::allgather_": ("all_gather", "output_tensors"),
        "c10d::allgather_coalesced_": ("all_gather", "output_lists"),
        "c10d::allgather_into_tensor_coalesced_": ("all_gather", "outputs"),
        "c10d::_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
        "c10d::reduce_scatter_": ("reduce_scatter", "input_tensors"),
        "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
        "c10d::broadcast_": ("broadcast", "tensors"),
        "c10d::reduce_": ("reduce", "tensors"),
        "c10d::alltoall_": ("all_to_all", "input_tensors"),
        "c10d::alltoall_base_": ("all_to_all", "input"),
        "c10d::gather_": ("gather", "output_tensors"),
        "c10d::scatter_": ("scatter", "input_tensors"),
        "c10d::send": ("send", "tensors"),
        "c10d::recv_": ("recv", "tensors"),
        "c10d::recv_any_source_": ("recv", "tensors"),
        "c10d::barrier": ("barrier", "tensor"),
        # The functional collectives DTensor uses (tensor parallelism, clip_grad_norm_ on DTensors).
        "_c10d_functional::all_reduce": ("all_reduce", "input"),
        "_c10d_functional::all_reduce_": ("all_reduce", "input"),
        "_c10d_functional::all_reduce_coalesced": ("all_reduce", "inputs"),
        "_c10d_functional::all_reduce_coalesced_": ("all_reduce", "inputs"),
        "_c10d_functional::all_gather_into_tensor": ("all_gather", "output"),
        "_c10d_functional::all_gather_into_tensor_out": ("all_gather", "output"),
        "_c10d_functional::all_gather_into_tensor_coalesced": ("all_gather", "output"),
        "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", "input"),
        "_c10d_functional::reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
        "_c10d_functional::all_to_all_single": ("all_to_all", "input"),
        "_c10d_functional::broadcast": ("broadcast", "input"),
        "_c10d_functional::broadcast_": ("broadcast", "input"),
    }


if __name__ == "__main__":
    main()
