"""Check chapter 06's tensor-parallel plan module by module against the same model in one process.

    torchrun --standalone --nproc-per-node 2 06-tensor-parallel/tp_layer_check.py

Every rank builds the tiny Llama twice: split with the chapter's own parallelize_model(), and whole, with the same
weights. Both run one forward and backward, first of decoder layer 0 alone, then of the whole model (with the
vocabulary-parallel loss), on the same input. Forward hooks compare each module's output with the whole model's as soon as it
is computed (a local slice is gathered first), then every parameter's gradient (param.grad.full_tensor()) and the
input's are compared. The worst difference of each is printed; the first module that differs is named in the last
line, "error: ...", and the exit status is 1.

TP_CHECK_BREAK=o_proj-colwise (or gate_proj-rowwise) gives that projection of layer 0 the wrong style, to show
where the check points: at o_proj, which fails on its input; at the MLP whose gate_proj returns a whole tensor
where its sibling up_proj returns a slice.
"""

import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import AutoConfig, AutoModelForCausalLM

# NOTE: the tiny bundled Llama, wherever the check is run from.
TINY_MODEL = Path(__file__).resolve().parents[1] / "data" / "tiny-llama"

BATCH, SEQ_LENGTH, NUM_LAYERS, SEED = 2, 16, 2, 0
# fp32 on the CPU: the split matmuls add the same products in another order, so differences are rounding (~1e-7),
# relative to the size of the values: a difference passes if it is within TOLERANCE x max(1, largest |value|).
TOLERANCE = 1e-5
BROKEN_STYLES = {
    "o_proj-colwise": ("self_attn.o_proj", ColwiseParallel()),
    "gate_proj-rowwise": ("mlp.gate_proj", RowwiseParallel()),
}


def break_layer_zero(chapter, broken):
    """Make the chapter's parallelize_model() give layer 0's `module` the wrong style: the rest of its plan stays."""
    module_name, wrong_style = BROKEN_STYLES[broken]
    parallelize_module = chapter.parallelize_module

    def parallelize_module_with_one_wrong_style(module, mesh, plan):
        if getattr(getattr(module, "self_attn", None), "layer_idx", None) == 0:
            plan = {**plan, module_name: wrong_style}
        return parallelize_module(module, mesh, plan)

    chapter.parallelize_module = parallelize_module_with_one_wrong_style


def build_models(chapter, mesh):
    """The split model, built as the chapter's main() builds it, and a whole copy with the same weights."""
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.num_hidden_layers = NUM_LAYERS
    with chapter.parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    chapter.parallelize_model(model, mesh)
    chapter.to_empty_keeping_buffers(model, torch.device("cpu"), cpu_offload=False)
    chapter.init_weights(model, SEED)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    reference.load_state_dict({name: full(param).detach() for name, param in model.named_parameters()}, strict=False)
    return model.train(), reference.train()


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def first_tensor(output):
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        output = next((item for item in output if torch.is_tensor(item)), None)
    return output if torch.is_tensor(output) else None


def gather(value, reference, mesh):
    """The whole value of a module's output: a DTensor's full tensor, or a local slice gathered along the one
    dimension where it is tp times smaller than the whole model's output. (None, layout) where it fits neither."""
    if isinstance(value, DTensor):
        return value.full_tensor(), f"DTensor {value.placements}"
    if value.shape == reference.shape:
        return value, "local, whole"
    smaller = [dim for dim in range(value.dim()) if value.shape[dim] != reference.shape[dim]]
    if value.dim() == reference.dim() and len(smaller) == 1 and value.shape[smaller[0]] * mesh.size() == reference.shape[smaller[0]]:
        return DTensor.from_local(value, mesh, [Shard(smaller[0])], run_check=False).full_tensor(), f"local, Shard({smaller[0]})"
    return None, f"local {tuple(value.shape)}, whole model {tuple(reference.shape)}"


class ModuleComparison:
    """Forward hooks that compare each split module's output with the whole model's, in the order they run.

    The whole model runs first and records its outputs; the split one compares each output as soon as its module
    returns, so a wrong placement is named at its module even if a later module then fails on the wrong shape.
    Its pre-hooks keep the stack of running modules, to name the module an error happened in.
    """

    def __init__(self, model, reference, mesh, prefix):
        self.mesh, self.reference_outputs, self.results, self.running, self.handles = mesh, {}, [], [], []
        for name, module in reference.get_submodule(prefix).named_modules(prefix=prefix):
            self.handles.append(module.register_forward_hook(self.recorder(name)))
        for name, module in model.get_submodule(prefix).named_modules(prefix=prefix):
            # NOTE: prepend=True runs the pre-hook before the input hooks parallelize_module() added, and the
            # forward hook runs after its output hooks: a failure in those happens while the module is on the stack.
            self.handles.append(module.register_forward_pre_hook(self.enter(name), prepend=True))
            self.handles.append(module.register_forward_hook(self.comparer(name)))

    def recorder(self, name):
        def hook(module, args, output):
            tensor = first_tensor(output)
            if tensor is not None:
                self.reference_outputs[name] = tensor.detach()
        return hook

    def enter(self, name):
        def hook(module, args):
            self.running.append(name)
        return hook

    def comparer(self, name):
        def hook(module, args, output):
            self.running.pop()
            tensor, reference = first_tensor(output), self.reference_outputs.get(name)
            if tensor is None or reference is None:
                return
            whole, layout = gather(tensor.detach(), reference, self.mesh)
            difference = float("inf") if whole is None else (whole - reference).abs().max().item()
            self.results.append((name, difference, layout, within(difference, reference)))
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def check(title, model, reference, mesh, prefix, run_forward_backward):
    """Run both models with hooks; print every module's output and every gradient's worst difference.

    Returns the first mismatch as a line of text, or None.
    """
    comparison = ModuleComparison(model, reference, mesh, prefix)
    failure = None
    try:
        run_forward_backward()
    except Exception as error:
        failure = f"{comparison.running[-1] if comparison.running else '?'} failed: {type(error).__name__}: " \
                  f"{str(error).strip().splitlines()[0]}"
    finally:
        comparison.remove()
    say(f"== {title}: module outputs, in the order they ran (worst |difference| to the whole model)")
    first_wrong_output = None
    for name, difference, layout, ok in comparison.results:
        say(f"   {name or '(the model)':45s} {difference:9.1e}   {layout}")
        if not ok and first_wrong_output is None:
            first_wrong_output = f"{name} output differs by {difference:.1e} ({layout})"
    if first_wrong_output is not None or failure is not None:
        # NOTE: a module whose output differs comes before any error it causes later on.
        if failure is not None:
            # NOTE: a module can fail on the layouts its submodules returned (a whole tensor from one projection,
            # a slice from its sibling): they are the place to look.
            failing_module = failure.partition(" ")[0]
            submodules = [f"{name} {layout}" for name, _, layout, _ in comparison.results
                          if name.rpartition(".")[0] == failing_module]
            failure += f"; its submodules returned: {', '.join(submodules) or 'nothing yet'}"
        return first_wrong_output or failure
    say(f"== {title}: gradients (worst |difference|; parameter and gradient placements)")
    wrong, worst_grad = [], ("none", 0.0)
    reference_parameters = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if prefix and not name.startswith(prefix + "."):
            continue
        reference_grad = reference_parameters[name].grad
        if param.grad is None or reference_grad is None:
            if (param.grad is None) != (reference_grad is None):
                wrong.append(f"{name}: a gradient on one side only")
            continue
        difference = (full(param.grad) - reference_grad).abs().max().item()
        placements = getattr(param, "placements", "plain"), getattr(param.grad, "placements", "plain")
        say(f"   {name:52s} {difference:9.1e}   param {placements[0]}, grad {placements[1]}")
        worst_grad = max(worst_grad, (name, difference), key=lambda named: named[1])
        if not within(difference, reference_grad):
            wrong.append(f"{name} gradient differs by {difference:.1e}")
    worst_output = max(comparison.results, key=lambda result: result[1])
    say(f"{title}: worst output difference {worst_output[1]:.1e} ({worst_output[0] or 'the model'}), "
        f"worst gradient difference {worst_grad[1]:.1e} ({worst_grad[0]})")
    if wrong:
        # NOTE: backward runs the modules in reverse: the last wrong gradient in forward order is the first
        # computed wrong; the wrong gradients before it may only have inherited the error.
        return wrong[-1]
    return None


def within(difference, reference):
    return difference <= TOLERANCE * max(1.0, reference.abs().max().item())


def say(line):
    if dist.get_rank() == 0:
        print(line, flush=True)


def main():
    dist.init_process_group(backend="gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    # NOTE: the chapter's own script, imported as a module: the check tests its parallelize_model(), not a copy.
    chapter = importlib.import_module("train_llm")  # beside this file: torchrun puts its folder on sys.path
    broken = os.environ.get("TP_CHECK_BREAK")
    if broken:
        break_layer_zero(chapter, broken)
        say(f"layer 0's {BROKEN_STYLES[broken][0]} is {type(BROKEN_STYLES[broken][1]).__name__} (wrong on purpose)")
    model, reference = build_models(chapter, mesh)
    config = model.config
    generator = torch.Generator().manual_seed(SEED)

    # 1. Decoder layer 0 alone, on the embedding output it would get in the model (whole, on every rank).
    hidden = torch.randn(BATCH, SEQ_LENGTH, config.hidden_size, generator=generator)
    output_grad = torch.randn(BATCH, SEQ_LENGTH, config.hidden_size, generator=generator)
    position_ids = torch.arange(SEQ_LENGTH).unsqueeze(0)
    inputs = {}

    def layer_forward_backward():
        for side, whole_model in [("reference", reference), ("split", model)]:
            inputs[side] = hidden.clone().requires_grad_()
            position_embeddings = whole_model.model.rotary_emb(inputs[side], position_ids)
            output = whole_model.model.layers[0](inputs[side], position_ids=position_ids,
                                                  position_embeddings=position_embeddings)
            # NOTE: the split layer returns this rank's chunk of the sequence; gather it (differentiably).
            output = gather(output, inputs["reference"], mesh)[0] if side == "split" else output
            (output * output_grad).sum().backward()

    failure = check("decoder layer 0", model, reference, mesh, "model.layers.0", layer_forward_backward)
    if failure is None:
        difference = (inputs["split"].grad - inputs["reference"].grad).abs().max().item()
        say(f"   {'input gradient':52s} {difference:9.1e}")
        failure = None if within(difference, inputs["reference"].grad) else \
            f"the layer's input gradient differs by {difference:.1e}"
    if failure is not None:
        raise SystemExit(f"error: decoder layer 0 does not match the whole model: first mismatch at {failure}")

    # 2. The whole model: token ids in, loss out, with the vocabulary-parallel loss as in the training step.
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ_LENGTH), generator=generator)
    losses = {}

    def model_forward_backward():
        losses["reference"] = reference(input_ids=input_ids, labels=input_ids).loss
        losses["reference"].backward()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        losses["split"] = loss.detach()

    failure = check("whole model", model, reference, mesh, "", model_forward_backward)
    if failure is None:
        difference = (losses["split"] - losses["reference"]).abs().item()
        say(f"   {'loss':52s} {difference:9.1e}   ({losses['reference'].item():.4f})")
        failure = None if within(difference, losses["reference"]) else f"the loss differs by {difference:.1e}"
    if failure is not None:
        raise SystemExit(f"error: the whole model does not match: first mismatch at {failure}")
    say(f"ok: every module output and gradient within {TOLERANCE:.0e} (relative) on {dist.get_world_size()} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
