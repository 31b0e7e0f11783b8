"""Check chapter 09's attention across the split against full causal attention, then the whole model module by module.

    torchrun --standalone --nproc-per-node 4 09-context-parallel/cp_attention_check.py

On 4 ranks, every layout 4 ranks make: cp 2 (a (2, 2) mesh) and cp 4 (a (1, 4) mesh); both forms (ring,
all-to-all); load balancing on and off. The chapter's own
script is imported as a module: what is checked is its get_token_indices(), its registered attention functions and
its get_model_inputs(), not a copy.

1. Attention alone: random queries, keys and values of whole sequences (the tiny Llama's grouped-query shapes: 8
   query heads, 4 key/value heads), every rank its own tokens; each rank's output and the gradients of its q, k and
   v (from a random output gradient) are gathered, put back in sequence order and compared with
   scaled_dot_product_attention(is_causal=True) over the whole sequences in one process.
2. The whole model (2 layers of the tiny Llama): token ids in, loss out, each rank its share of the micro-batch as
   the chapter's training step cuts it (dp rows read different sequences). Every module's output (gathered over
   the cp ranks, back in order), the loss (the sum of the ranks' shares) and every parameter's gradient (summed
   over all ranks, as FSDP sums them) against the whole model on the whole global batch.
3. The layout of load balancing is PyTorch's own (_HeadTailLoadBalancer, what its context_parallel() uses), so that
   the README's sketch of context_parallel() cuts the tokens where the chapter does.

Prints the worst difference of each case; "error: ..." and exit status 1 on the first that is off.
CP_CHECK_BREAK=ring-sees-the-future breaks the ring's causal mask across ranks (every other rank's keys visible to
every query), to show that the check fails, and where.
fp32, differences relative to the largest value (where it is above 1: rounding is relative): attention within
1e-6 on the CPU (2e-5 on CUDA, whose fused kernels round differently), the whole model within 1e-5.
"""

import copy
import importlib
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# NOTE: the tiny bundled Llama, wherever the check is run from.
TINY_MODEL = Path(__file__).resolve().parents[1] / "data" / "tiny-llama"

BATCH, SEQ_LENGTH, NUM_LAYERS, SEED = 2, 64, 2, 0
DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else \
    torch.device("cpu")
TOLERANCE = 2e-5 if DEVICE.type == "cuda" else 1e-6
FORMS = ["ring", "all-to-all"]


def say(line):
    if dist.get_rank() == 0:
        print(line, flush=True)


def gather_in_order(local, cp_mesh, load_balance, seq_dim):
    """The whole sequence from every cp rank's tokens, back in sequence order (all_gather: the check, not the
    chapter, so a plain collective)."""
    group, size = cp_mesh.get_group(), cp_mesh.size()
    pieces = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    gathered = torch.cat(pieces, dim=seq_dim)
    layout = torch.cat([chapter.get_token_indices(gathered.shape[seq_dim], rank, size, load_balance, local.device)
                        for rank in range(size)])
    return gathered.index_select(seq_dim, layout.argsort())


def check_attention_alone(cp_mesh, form, load_balance):
    config = AutoConfig.from_pretrained(TINY_MODEL)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    generator = torch.Generator().manual_seed(SEED)
    # NOTE: the same whole tensors on every rank (same seed); each rank then takes its own tokens.
    whole = {name: torch.randn(BATCH, count, SEQ_LENGTH, head_dim, generator=generator).to(DEVICE)
             for name, count in [("query", heads), ("key", kv_heads), ("value", kv_heads)]}
    grad_output = torch.randn(BATCH, SEQ_LENGTH, heads, head_dim, generator=generator).to(DEVICE)

    reference = {name: tensor.clone().requires_grad_() for name, tensor in whole.items()}
    reference_output = torch.nn.functional.scaled_dot_product_attention(
        reference["query"], reference["key"], reference["value"], is_causal=True, enable_gqa=True).transpose(1, 2)
    (reference_output * grad_output).sum().backward()

    indices = chapter.get_token_indices(SEQ_LENGTH, cp_mesh.get_local_rank(), cp_mesh.size(), load_balance, DEVICE)
    local = {name: tensor[:, :, indices].clone().requires_grad_() for name, tensor in whole.items()}
    name = chapter.register_context_parallel_attention(form, cp_mesh, load_balance)
    attention = ALL_ATTENTION_FUNCTIONS[name]
    output, _ = attention(None, local["query"], local["key"], local["value"], None, scaling=head_dim ** -0.5)
    (output * grad_output[:, indices]).sum().backward()

    pairs = {"output": (gather_in_order(output.detach(), cp_mesh, load_balance, 1), reference_output.detach())}
    for tensor_name in whole:
        pairs[f"grad {tensor_name[0]}"] = (gather_in_order(local[tensor_name].grad, cp_mesh, load_balance, 2),
                                           reference[tensor_name].grad)
    return {key: relative_difference(*pair) for key, pair in pairs.items()}


def relative_difference(value, reference):
    """The largest difference, relative to the largest value where that is above 1: fp32 rounding is relative."""
    return ((value - reference).abs().max() / reference.abs().max().clamp(min=1.0)).item()


def build_models():
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.num_hidden_layers = NUM_LAYERS
    # NOTE: transformers' own initialization, from the same seed on every rank: the same weights everywhere.
    torch.manual_seed(SEED)
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return config, reference.to(DEVICE).train()


def record_outputs(model, store):
    def recorder(name):
        def hook(module, args, output):
            tensor = getattr(output, "logits", None)
            if tensor is None:
                tensor = output[0] if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple") else output
            if torch.is_tensor(tensor) and tensor.dim() >= 2:
                store[name] = tensor.detach()
        return hook
    return [module.register_forward_hook(recorder(name)) for name, module in model.named_modules()]


def check_whole_model(mesh, form, load_balance, config, reference):
    cp_mesh, dp_mesh = mesh["cp"], mesh["dp"]
    generator = torch.Generator().manual_seed(SEED)
    # NOTE: the global micro-batch: dp rows of BATCH sequences each; this dp row reads its own rows.
    global_batch = torch.randint(0, config.vocab_size, (BATCH * dp_mesh.size(), SEQ_LENGTH), generator=generator)
    global_batch = global_batch.to(DEVICE)
    input_ids = global_batch[dp_mesh.get_local_rank() * BATCH:(dp_mesh.get_local_rank() + 1) * BATCH]

    reference.zero_grad(set_to_none=True)
    reference_outputs, split_outputs = {}, {}
    handles = record_outputs(reference, reference_outputs)
    reference_loss = reference(input_ids=global_batch, labels=global_batch, use_cache=False).loss
    reference_loss.backward()
    for handle in handles:
        handle.remove()

    name = chapter.register_context_parallel_attention(form, cp_mesh, load_balance)
    # NOTE: a copy of the config: from_config() writes the attention implementation into the one it is given.
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name, dtype=torch.float32)
    model = model.to(DEVICE)
    model.load_state_dict(reference.state_dict())
    model.train()
    handles = record_outputs(model, split_outputs)
    local_ids, position_ids, shift_labels, num_items = chapter.get_model_inputs(input_ids, cp_mesh, dp_mesh,
                                                                                load_balance)
    loss = model(input_ids=local_ids, position_ids=position_ids, labels=shift_labels, shift_labels=shift_labels,
                 num_items_in_batch=num_items, use_cache=False).loss
    loss.backward()
    for handle in handles:
        handle.remove()

    # The module outputs of this dp row's sequences, gathered over its cp ranks.
    own_rows = slice(dp_mesh.get_local_rank() * BATCH, (dp_mesh.get_local_rank() + 1) * BATCH)
    worst_output = ("none", -1.0)
    for module_name, local in split_outputs.items():
        # NOTE: the rotary embeddings' cos and sin have a batch dimension of 1 in the reference (no position_ids).
        if module_name not in reference_outputs or reference_outputs[module_name].shape[0] != BATCH * dp_mesh.size():
            continue
        difference = relative_difference(gather_in_order(local, cp_mesh, load_balance, 1),
                                         reference_outputs[module_name][own_rows])
        worst_output = max(worst_output, (module_name, difference), key=lambda named: named[1])
    total_loss = loss.detach().clone()
    dist.all_reduce(total_loss)
    worst_grad = ("none", -1.0)
    reference_parameters = dict(reference.named_parameters())
    for parameter_name, parameter in model.named_parameters():
        grad = parameter.grad.clone()
        dist.all_reduce(grad)
        reference_grad = reference_parameters[parameter_name].grad
        difference = relative_difference(grad, reference_grad)
        worst_grad = max(worst_grad, (parameter_name, difference), key=lambda named: named[1])
    return {"module output": worst_output, "loss": ("loss", relative_difference(total_loss, reference_loss)),
            "parameter grad": worst_grad}


def check_pytorch_layout(cp_size):
    indices = _HeadTailLoadBalancer(SEQ_LENGTH, cp_size, "cpu")._generate_indices()[0]
    ours = torch.cat([chapter.get_token_indices(SEQ_LENGTH, rank, cp_size, True, "cpu") for rank in range(cp_size)])
    return torch.equal(indices, ours)


def main():
    global chapter
    dist.init_process_group(backend="nccl" if DEVICE.type == "cuda" else "gloo")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
    world_size = dist.get_world_size()
    chapter = importlib.import_module("train_llm")  # beside this file: torchrun puts its folder on sys.path
    if os.environ.get("CP_CHECK_BREAK") == "ring-sees-the-future":
        chapter.visible_block = lambda rank, source, length, load_balance: (slice(None), slice(None), source == rank)
        say("the ring's visible_block() lets every query see every other rank's keys (wrong on purpose)")
    failures = []
    config, reference = build_models()
    for cp_size in [size for size in (2, 4) if world_size % size == 0]:
        mesh = chapter.get_device_mesh(DEVICE, world_size, cp_size)
        say(f"== cp {cp_size} (mesh {dict(zip(mesh.mesh_dim_names, mesh.mesh.shape))}); PyTorch's head-tail layout "
            f"is ours: {check_pytorch_layout(cp_size)}")
        if not check_pytorch_layout(cp_size):
            failures.append(f"cp {cp_size}: load balancing's layout differs from PyTorch's _HeadTailLoadBalancer")
        for form in FORMS:
            for load_balance in (True, False):
                case = f"cp {cp_size}, {form}, load balancing {'on' if load_balance else 'off'}"
                attention = check_attention_alone(mesh["cp"], form, load_balance)
                say(f"   {case:40s} attention alone: "
                    + ", ".join(f"{key} {value:.1e}" for key, value in attention.items()))
                failures += [f"{case}: attention {key} differs by {value:.1e}" for key, value in attention.items()
                             if not value <= TOLERANCE]
                whole = check_whole_model(mesh, form, load_balance, config, reference)
                say(f"   {case:40s} whole model: " + ", ".join(f"{key} {value:.1e} ({name})"
                                                                for key, (name, value) in whole.items()))
                failures += [f"{case}: whole model {key} differs by {value:.1e} at {name}"
                             for key, (name, value) in whole.items() if not value <= 1e-5]
    # NOTE: the chapter's forms take no mask; transformers must build none for them.
    unmasked = [name for name in ALL_ATTENTION_FUNCTIONS if name.startswith("context_parallel_")
                and name in ALL_MASK_ATTENTION_FUNCTIONS]
    if unmasked:
        failures.append(f"transformers would build masks for {unmasked}")
    if failures:
        raise SystemExit(f"error: {failures[0]} ({len(failures)} failures)")
    say(f"ok: every output and gradient within {TOLERANCE:.0e} of full causal attention, and the whole model within "
        f"1e-05 (relative), on {world_size} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
