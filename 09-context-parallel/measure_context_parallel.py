"""Measure what context parallelism saves and what load balancing evens out (chapter 09), on the CPU.

    torchrun --standalone --nproc-per-node 4 09-context-parallel/measure_context_parallel.py

1. Activation memory per rank against the sequence length, for cp 1, 2 and 4 (on 4 processes: meshes (4, 1),
   (2, 2) and (1, 4)): the bytes autograd keeps from one forward pass of the bundled tiny Llama (batch 1) for the
   backward pass, counted with saved-tensor hooks (each storage once; the weights, which are not activations, left
   out). That is the activation memory at its peak, the end of forward. Cut with the chapter's own
   get_model_inputs(), attention by the chapter's ring (or --form all-to-all).
2. Ring attention's work per rank, with load balancing on and off, for cp 2 and 4: the attention scores each rank
   computes in one forward pass of one attention layer (query-key entries of the blocks it gives the kernel, the
   masked half of its own causal block included; counted in a real ring over the processes: exact), and the
   milliseconds each rank's blocks take to compute, forward and backward (the chapter's visible_block(),
   attention_block() and attention_block_backward(), replayed one rank after the other in one process and timed in
   CPU time, so that neither the ranks nor other programs on the machine compete in the figure; the ring as a whole
   waits for the slowest rank).
3. Llama-3.1-8B's activations per GPU at 8K, 32K and 128K tokens, for cp 1, 8 and 16: the same saved-tensor count,
   on the meta device (shapes and dtypes, no memory and no computation: any size "runs" in seconds), in bf16 as FSDP's
   mixed precision computes, with attention keeping what FlashAttention keeps (queries, keys, values, output and
   log-sum-exp, no scores). A rank of a cp group keeps what a sequence of seq_length / cp tokens keeps (part 1 shows
   it to within a few bytes), so each entry is one forward pass of seq_length / cp tokens.

Prints three Markdown tables, and with --json a file with every figure.
"""

import argparse
import copy
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTER = Path(__file__).resolve().parent / "train_llm.py"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--form", choices=["ring", "all-to-all"], default="ring", help="attention for part 1")
    parser.add_argument("--attention-seq-length", type=int, default=4096, help="tokens per sequence in part 2")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each rank's blocks in part 2 (median)")
    parser.add_argument("--skip-memory", action="store_true", help="leave out part 1")
    parser.add_argument("--skip-llama-8b", action="store_true", help="leave out part 3")
    parser.add_argument("--json", default=None, help="write every figure to this file")
    args = parser.parse_args()
    dist.init_process_group(backend="gloo")
    world_size = dist.get_world_size()
    chapter = load_chapter()
    cp_sizes = [size for size in (1, 2, 4) if world_size % size == 0]

    memory = {}
    for cp_size in [] if args.skip_memory else cp_sizes:
        mesh = chapter.get_device_mesh(torch.device("cpu"), world_size, cp_size)
        for seq_length in args.seq_lengths:
            saved = activation_bytes(chapter, mesh, args.form, seq_length)
            memory[f"{cp_size}/{seq_length}"] = max(all_ranks(saved))

    work = {}
    for cp_size in [size for size in cp_sizes if size > 1]:
        mesh = chapter.get_device_mesh(torch.device("cpu"), world_size, cp_size)
        for load_balance in (True, False):
            scores = scores_computed(chapter, mesh["cp"], load_balance, args.attention_seq_length)
            # NOTE: cp group 0 (ranks 0 .. cp_size - 1) speaks for all: every group does the same.
            work[f"{cp_size}/{'on' if load_balance else 'off'}"] = {"scores_computed": all_ranks(scores)[:cp_size]}
            if dist.get_rank() == 0:
                work[f"{cp_size}/{'on' if load_balance else 'off'}"]["compute_ms"] = replayed_compute_ms(
                    chapter, cp_size, load_balance, args.attention_seq_length, args.repeats)

    llama_8b = {} if args.skip_llama_8b or dist.get_rank() != 0 else llama_8b_activation_bytes()

    if dist.get_rank() == 0:
        print_tables(memory, work, llama_8b, cp_sizes, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"activation_bytes": memory, "attention": work,
                                                   "llama_8b_bytes": llama_8b}, indent=1))
    dist.destroy_process_group()


def load_chapter():
    spec = importlib.util.spec_from_file_location("train_llm_09", CHAPTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def all_ranks(value):
    """Every rank's value of a number, in rank order."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def build_model(chapter, cp_mesh, form, max_positions):
    config = AutoConfig.from_pretrained(REPO_ROOT / "data" / "tiny-llama")
    config.max_position_embeddings = max(config.max_position_embeddings, max_positions)
    attn_implementation = "sdpa" if cp_mesh.size() == 1 else \
        chapter.register_context_parallel_attention(form, cp_mesh, load_balance=True)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn_implementation,
                                            dtype=torch.float32).train(), config


def activation_bytes(chapter, mesh, form, seq_length):
    """Bytes autograd keeps from one forward pass (batch 1) on this rank: each storage once, weights left out."""
    model, config = build_model(chapter, mesh["cp"], form, seq_length)
    weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    input_ids = torch.randint(0, config.vocab_size, (1, seq_length), generator=torch.Generator().manual_seed(0))
    local_ids, position_ids, shift_labels, num_items = chapter.get_model_inputs(input_ids, mesh["cp"], mesh["dp"],
                                                                                load_balance=True)
    storages = {}

    def keep(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    # NOTE: forward only: what it keeps is the peak; backward frees it again.
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model(input_ids=local_ids, position_ids=position_ids, labels=shift_labels, shift_labels=shift_labels,
              num_items_in_batch=num_items, use_cache=False)
    return sum(storages.values())


def attention_inputs(seq_length, cp_size, seed):
    """One attention layer's queries, keys and values of one rank, the tiny Llama's shape, batch 1."""
    config = AutoConfig.from_pretrained(REPO_ROOT / "data" / "tiny-llama")
    tokens = seq_length // cp_size
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, config.num_attention_heads, tokens, config.head_dim, generator=generator)
    key, value = (torch.randn(1, config.num_key_value_heads, tokens, config.head_dim, generator=generator)
                  for _ in range(2))
    return query, key, value, config.head_dim ** -0.5


def scores_computed(chapter, cp_mesh, load_balance, seq_length):
    """The query-key scores this rank computes in the forward pass of the chapter's ring (a real one, over cp_mesh).

    NOTE: rows x columns of every block given to the kernel: a causal block counts whole, though the fused kernel
    skips the tiles its mask hides entirely.
    """
    query, key, value, scale = attention_inputs(seq_length, cp_mesh.size(), dist.get_rank())
    scores = 0
    original = chapter.attention_block

    def counted(block_query, block_key, block_value, block_scale, causal):
        nonlocal scores
        scores += block_query.shape[2] * block_key.shape[2]
        return original(block_query, block_key, block_value, block_scale, causal)

    chapter.attention_block = counted
    try:
        name = chapter.register_context_parallel_attention("ring", cp_mesh, load_balance)
        inputs = [tensor.requires_grad_() for tensor in (query, key, value)]
        output, _ = ALL_ATTENTION_FUNCTIONS[name](None, *inputs, None, scaling=scale)
        output.sum().backward()
    finally:
        chapter.attention_block = original
    return scores


def replayed_compute_ms(chapter, cp_size, load_balance, seq_length, repeats):
    """CPU milliseconds of each cp rank's block computations, forward and backward, one rank after the other.

    NOTE: process time, not the wall clock: on a shared machine other programs take turns on the cores, which the
    wall clock would count; one thread (OMP_NUM_THREADS=1), so CPU time is compute time.
    """
    query, key, value, scale = attention_inputs(seq_length, cp_size, 0)
    per_rank = []
    for rank in range(cp_size):
        blocks = [chapter.visible_block(rank, (rank - step) % cp_size, query.shape[2], load_balance)
                  for step in range(cp_size)]
        times = []
        for _ in range(repeats + 1):
            started = time.process_time()
            for rows, columns, causal in filter(None, blocks):
                block_query, block_key, block_value = query[:, :, rows], key[:, :, columns], value[:, :, columns]
                output, lse = chapter.attention_block(block_query, block_key, block_value, scale, causal)
                chapter.attention_block_backward(output, block_query, block_key, block_value, output, lse, scale,
                                                 causal)
            times.append((time.process_time() - started) * 1000)
        # NOTE: the first pass warms up (allocations, thread pools); the median of the others is reported.
        per_rank.append(statistics.median(times[1:]))
    return per_rank


# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B on the Hugging Face hub, a gated download), the values that
# shape its activations.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                tie_word_embeddings=False)


class KeptLikeFlashAttention(torch.autograd.Function):
    """What FlashAttention keeps for backward: queries, keys, values, output and log-sum-exp; shapes only (meta).

    The output is laid out as (batch, tokens, heads, head_dim), as the fused kernels return it, so o_proj's input
    is the same tensor.
    """

    @staticmethod
    def forward(ctx, query, key, value):
        batch, heads, tokens, head_dim = query.shape
        output = query.new_empty(batch, tokens, heads, head_dim).transpose(1, 2)
        lse = query.new_empty(batch, heads, tokens, dtype=torch.float32)
        ctx.save_for_backward(query, key, value, output, lse)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError("shapes only")


def llama_8b_activation_bytes():
    """{"cp/seq_length": bytes} kept by one GPU, batch 1, for Llama-3.1-8B, on the meta device."""
    AttentionInterface.register("kept_like_fused_kernels", lambda module, query, key, value, *args, **kwargs: (
        KeptLikeFlashAttention.apply(query, key, value).transpose(1, 2), None))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA_8B), attn_implementation="kept_like_fused_kernels",
                                                 dtype=torch.bfloat16).train()
    weights = {parameter.untyped_storage()._cdata for parameter in model.parameters()}
    figures = {}
    for seq_length in (8192, 32768, 131072):
        for cp_size in (1, 8, 16):
            tokens = seq_length // cp_size
            storages = {}

            def keep(tensor):
                # NOTE: meta storages have no addresses; _cdata tells them apart.
                storage = tensor.untyped_storage()
                if storage._cdata not in weights:
                    storages[storage._cdata] = storage.nbytes()
                return tensor

            input_ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                model(input_ids=input_ids, labels=input_ids, use_cache=False)
            figures[f"{cp_size}/{seq_length}"] = sum(storages.values())
    return figures


def print_tables(memory, work, llama_8b, cp_sizes, args):
    if memory:
        print(f"\nActivation memory per rank: bytes kept for backward after one forward pass, batch 1, "
              f"{args.form} attention (MB)\n")
        print("| tokens per sequence | " + " | ".join(f"cp {size}" for size in cp_sizes) + " | "
              + " | ".join(f"cp {size} / cp 1" for size in cp_sizes[1:]) + " |")
        print("| --- " * (2 * len(cp_sizes)) + "|")
        for seq_length in args.seq_lengths:
            values = [memory[f"{size}/{seq_length}"] for size in cp_sizes]
            print(f"| {seq_length:,} | " + " | ".join(f"{value / 1e6:.1f}" for value in values) + " | "
                  + " | ".join(f"{value / values[0]:.3f}" for value in values[1:]) + " |")
    print(f"\nRing attention, one layer, {args.attention_seq_length:,} tokens, per rank of a cp group: query-key "
          "scores computed in forward (thousands), CPU milliseconds computing its blocks forward and backward; "
          "the ring waits for the slowest rank\n")
    print("| cp | load balancing | " + " | ".join(f"rank {rank}" for rank in range(max(cp_sizes)))
          + " | slowest rank / mean |")
    print("| --- " * (3 + max(cp_sizes)) + "|")
    for key, figures in work.items():
        cp_size, balance = key.split("/")
        cells = [f"{scores / 1e3:,.0f}k, {ms:,.0f} ms" for scores, ms in zip(figures["scores_computed"],
                                                                          figures["compute_ms"])]
        cells += [""] * (max(cp_sizes) - len(cells))
        slowest = max(figures["compute_ms"]) / statistics.mean(figures["compute_ms"])
        print(f"| {cp_size} | {balance} | " + " | ".join(cells) + f" | {slowest:.2f} |")
    if llama_8b:
        print("\nLlama-3.1-8B, activations kept per GPU after one forward pass, batch 1, bf16, no activation "
              "checkpointing (GB)\n")
        print("| tokens per sequence | cp 1 | cp 8 | cp 16 |")
        print("| --- | --- | --- | --- |")
        for seq_length in (8192, 32768, 131072):
            print(f"| {seq_length:,} | " + " | ".join(f"{llama_8b[f'{cp_size}/{seq_length}'] / 1e9:,.1f}"
                                                     for cp_size in (1, 8, 16)) + " |")


if __name__ == "__main__":
    main()
