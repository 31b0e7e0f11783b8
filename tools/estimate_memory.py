"""Estimate what one training step of this guide's scripts holds and sends on one GPU, for any Hugging Face model
config and parallel layout: parameters, gradients, optimizer state, activations, the transient buffers (gathered
layers, unsharded gradients, the loss's gradient), and the bytes each GPU sends per step, with the time that takes.

    python tools/estimate_memory.py -m data/configs/llama-3.1-8b --fsdp --dp 8
    python tools/estimate_memory.py -m data/configs/llama-3.1-70b --tp 8 --dp 4 --fsdp --batch-size 1 --seq-length 4096
    python tools/estimate_memory.py -m data/configs/llama-3.1-405b --fsdp --dp 64 --activation-checkpointing --cpu-offload
    python tools/estimate_memory.py --dp 2 --zero1 --dtype float32 --json

-m takes a local folder with config.json or a hub name (only the config is read, never weights; offline, a local
folder works). The layout flags are the chapters' own:

    (nothing)              chapter 01: one GPU
    --dp N                 chapter 02/03: DDP over N GPUs; with --zero1, ZeroRedundancyOptimizer
    --dp N --fsdp          chapter 04: FSDP2, one group per decoder layer and a root group; --split-root-group for
                           chapter 05's groups; --activation-checkpointing and --cpu-offload as in chapter 05
    --tp T                 chapter 06: tensor + sequence parallel, loss parallel
    --tp T --dp N --fsdp   chapter 07: TP inside a node, FSDP across (--dp-replicate R for hybrid sharding)
    --pp P                 chapter 08: P pipeline stages (1F1B; --pp-schedule for GPipe or interleaved 1F1B),
                           FSDP inside each with --fsdp
    --cp C                 chapter 09: ring attention over C ranks, FSDP over dp x cp with --fsdp
    --dp N --fsdp --ep E   chapter 10: a mixture of experts' experts split over E ranks (E/ep whole experts each),
                           FSDP over the dp/E ranks that hold the same experts, tokens sent by all-to-all; the rest
                           FSDP over all N ranks as in chapter 04 (--ep 1: FSDP alone, every expert gathered)

Sizes are per GPU, for the rank given by --rank (default 0; with FSDP a rank whose rows do not divide evenly holds
fewer). The tests (tests/test_estimate_memory.py) compare parameters, gradients and optimizer state, to the byte,
and the communication per step, within 1%, with what tools/measure_step.py measures in the chapters' scripts on
CPUs, and the activations with the measured peak of live tensors within 15%. The bf16 activation widths follow
the op-by-op accounting of chapter 01's README (CUDA's autocast runs attention in bf16; a CPU runs it in fp32), and
are not measured here. A mixture of experts' MLP (moe_mlp_bytes_per_token) is held to what transformers' own MoE
block saves, within 2%, and with it chapter 10's step peak (ep 2 x edp 2) to the measured one, within 15%. "Bytes
sent" is defined in tools/measure_step.py: a ring all-reduce sends 2(N-1)/N of its buffer, an all-gather,
reduce-scatter or all-to-all (N-1)/N of the full tensor.
"""

import argparse
import functools
import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_step import bytes_sent  # noqa: E402  (one definition of "bytes sent" for the meter and the estimate)

# Default link bandwidths per GPU and direction: NVLink 4 on H100/H200 (900 GB/s both ways), and one 400 Gb/s
# InfiniBand NIC per GPU (50 GB/s).
DEFAULT_BANDWIDTHS_GBS = [450.0, 50.0]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}

# Chapter 06's tensor-parallel plan, by the parameter's name inside a decoder layer: which dimension is split.
COLUMNWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def main():
    args = parse_args()
    config = load_config(args.model_name)
    layout = layout_from_args(args)
    estimate = estimate_step(config, layout)
    if args.json:
        print(json.dumps(estimate, indent=2))
    else:
        print_estimate(estimate, args.bandwidth_gbs)


def get_parser():
    parser = argparse.ArgumentParser(
        description="Estimate per-GPU memory (parameters, gradients, optimizer state, activations, transient "
                    "buffers) and communication per training step for a Hugging Face config and a parallel layout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("-m", "--model-name", default=str(REPO_ROOT / "data" / "tiny-llama"),
                        help="local folder with config.json, or a Hugging Face hub name (config only)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (DDP ranks, or FSDP's shard ranks)")
    parser.add_argument("--zero1", action="store_true", help="shard the optimizer state over --dp (chapter 02)")
    parser.add_argument("--zero2", action="store_true",
                        help="shard gradients and optimizer state over --dp (ZeRO-2: no chapter implements it)")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters, gradients, optimizer state (FSDP2)")
    parser.add_argument("--dp-replicate", type=int, default=1,
                        help="hybrid sharding: FSDP shards within --dp / R ranks, R replicas (chapter 07)")
    parser.add_argument("--split-root-group", action="store_true",
                        help="chapter 05's FSDP groups: the embedding freed after its forward, norm and head apart")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (chapter 06's plan)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks (chapter 08)")
    parser.add_argument("--pp-schedule", choices=list(IN_FLIGHT), default="1f1b",
                        help="chapter 08's and 11's schedule")
    parser.add_argument("--pp-stages-per-rank", type=int, default=2, help="interleaved 1F1B's stages on each rank")
    parser.add_argument("--pp-grad-reduce", choices=["microbatch", "step"], default="microbatch",
                        help="chapter 08's and 11's: gradients reduce-scattered in every micro-batch, or once a step")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel degree (chapter 09, ring attention)")
    parser.add_argument("--ep", type=int, default=None,
                        help="expert-parallel degree (chapter 10, with --fsdp): each rank holds experts / E experts")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="keep only each decoder layer's input, recompute the rest in backward (chapter 05)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="FSDP's sharded parameters, gradients and optimizer state in CPU memory")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per data-parallel rank")
    parser.add_argument("--seq-length", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (pipeline: per stage)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="compute dtype: bfloat16 is the scripts' --dtype auto on a GPU, float32 on a CPU")
    parser.add_argument("--rank", type=int, default=0, help="the rank to report")
    parser.add_argument("--bandwidth-gbs", type=float, nargs="+", default=DEFAULT_BANDWIDTHS_GBS,
                        help="link bandwidths per GPU and direction, in GB/s, to time the communication at "
                             "(defaults: NVLink, 400 Gb/s InfiniBand)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def parse_args():
    args = get_parser().parse_args()
    for name in ["dp", "tp", "pp", "cp", "dp_replicate", "batch_size", "seq_length", "grad_accum"]:
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.zero1 + args.zero2 + args.fsdp > 1:
        fail("choose one of --zero1, --zero2 and --fsdp: FSDP already shards what the ZeRO stages shard")
    if args.dp_replicate > 1 and not args.fsdp:
        fail("--dp-replicate is FSDP's hybrid sharding; add --fsdp")
    if args.dp % args.dp_replicate:
        fail(f"--dp-replicate {args.dp_replicate} does not divide --dp {args.dp}")
    if (args.cpu_offload or args.split_root_group) and not args.fsdp:
        fail("--cpu-offload and --split-root-group are FSDP options; add --fsdp")
    world_size = args.dp * args.tp * args.pp * args.cp
    if not 0 <= args.rank < world_size:
        fail(f"--rank {args.rank} is not a rank of the {world_size} GPUs (dp x tp x pp x cp)")
    return args


def fail(message):
    raise SystemExit(f"error: {message}")


def load_config(model_name):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"cannot load a model config from {model_name!r} ({first_line}); pass -m a local folder with "
             "config.json (data/configs/ has Llama 3.1 8B, 70B and 405B, Qwen3-30B-A3B and 235B-A22B) or a hub "
             "name, online")


@dataclass
class Layout:
    """A parallel layout and a step's shape. The defaults are chapter 01's CPU run."""

    dp: int = 1
    zero1: bool = False
    zero2: bool = False
    fsdp: bool = False
    dp_replicate: int = 1
    split_root_group: bool = False
    tp: int = 1
    pp: int = 1
    pp_grad_reduce: str = "microbatch"
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 2      # interleaved 1F1B's (the chapters' default); one for the other schedules
    cp: int = 1
    ep: int | None = None       # None: no expert parallelism (chapter 04's FSDP treats experts as any parameter)
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    batch_size: int = 8
    seq_length: int = 256
    grad_accum: int = 1
    dtype: str = "float32"
    rank: int = 0

    @property
    def reduces_once_per_step(self):
        """--pp-grad-reduce step (chapters 08, 11): FSDP's gradients accumulate whole until the step's last backward."""
        return self.fsdp and self.pp > 1 and self.pp_grad_reduce == "step"

    @property
    def stages_per_rank(self):
        if self.pp_schedule in V_SCHEDULES:
            return 2
        return self.pp_stages_per_rank if self.pp_schedule.startswith("interleaved") else 1

    @property
    def last_stage_rank(self):
        """The pipeline rank of the last stage (the norm, the head, the loss): rank 0 in a V, else the last."""
        return 0 if self.pp_schedule in V_SCHEDULES else self.pp - 1

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_shard(self):
        return self.dp // self.dp_replicate

    @property
    def fsdp_shards(self):
        """The ranks FSDP shards a parameter over: NOTE: context-parallel ranks hold the same weights and compute
        on other tokens, like data-parallel ones, so FSDP shards over them too (as torchtitan does)."""
        return self.dp_shard * self.cp

    @property
    def edp(self):
        """Chapter 10's expert-data-parallel degree: the ranks that hold the same experts (FSDP shards them over)."""
        return self.dp // (self.ep or 1)


def layout_from_args(args):
    names = Layout.__dataclass_fields__
    return Layout(**{name: getattr(args, name) for name in names})


# ---------------------------------------------------------------------------------------------------------------------
# The model, as its parameters


@dataclass
class Parameter:
    name: str
    shape: tuple
    layer: int | None           # decoder layer index, None for the embedding, final norm and head
    role: str                   # "embedding", "head", "norm", "colwise", "rowwise", "rowwise_bias", "expert",
                                # "replicate"


def model_parameters(config):
    """Every parameter of the model the config describes, built on the meta device: names and shapes, no memory.

    NOTE: a tied output head shares the embedding's parameter, and named_parameters() lists it once, as the
    scripts' optimizers and memory counts see it.
    """
    return list(meta_model(config)[0])


META_MODELS = {}


def meta_model(config):
    """(parameters, buffer bytes) of the model a config describes, built on the meta device once per config (its
    class and JSON): a 405B model's 126 layers take seconds to build, and a table estimates many layouts of one."""
    import torch
    from transformers import AutoModelForCausalLM

    key = type(config).__name__ + config.to_json_string(use_diff=False)
    if key in META_MODELS:
        return META_MODELS[key]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = []
    for name, param in model.named_parameters():
        match = re.search(r"\.layers\.(\d+)\.(.*)", name)
        layer, local_name = (int(match.group(1)), match.group(2)) if match else (None, name)
        if name.endswith("embed_tokens.weight"):
            role = "embedding"
        elif name.startswith("lm_head."):
            role = "head"
        elif local_name.startswith("mlp.experts.") and param.ndim == 3:
            role = "expert"  # NOTE: transformers' 3D experts (Qwen3-MoE, Mixtral): (experts, out, in) each
        elif "norm" in local_name:
            role = "norm"
        elif local_name.startswith(COLUMNWISE):
            role = "colwise"
        elif local_name.startswith(ROWWISE):
            role = "rowwise" if local_name.endswith("weight") else "rowwise_bias"
        else:
            role = "replicate"
        parameters.append(Parameter(name, tuple(param.shape), layer, role))
    META_MODELS[key] = tuple(parameters), sum(4 * buffer.numel() for _, buffer in model.named_buffers())
    return META_MODELS[key]


def model_buffer_bytes(config):
    """The bytes of the model's buffers (Llama's rotary frequencies), which DDP broadcasts at every forward."""
    return meta_model(config)[1]


@dataclass
class Dimensions:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tied: bool
    experts: int = 0            # a mixture of experts': experts per MoE layer, of which top_k run per token
    top_k: int = 0
    moe_intermediate: int = 0   # an expert's MLP width
    moe_layers: tuple = ()      # the decoder layers with experts

    @property
    def q_dim(self):
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim


def model_dimensions(config, parameters=()):
    """The sizes the activations and collectives depend on; a mixture of experts' from its experts' 3D parameters."""
    heads = config.num_attention_heads
    experts = [p for p in parameters if p.role == "expert" and p.name.endswith("down_proj")]
    return Dimensions(
        hidden=config.hidden_size, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, vocab=config.vocab_size, layers=config.num_hidden_layers,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        experts=experts[0].shape[0] if experts else 0,
        top_k=getattr(config, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate=experts[0].shape[2] if experts else 0, moe_layers=tuple(p.layer for p in experts))


def check_layout(parameters, dims, layout):
    if layout.ep is not None:
        check_expert_layout(parameters, dims, layout)
    if layout.tp > 1:
        unknown = sorted({p.name for p in parameters if p.role == "replicate"})
        if unknown:
            fail(f"chapter 06's tensor-parallel plan does not cover {unknown[:3]}: it is written for Llama-style "
                 "decoders (q/k/v/o projections, a gated MLP, RMSNorms)")
        for what, size in [("attention heads", dims.heads), ("key/value heads", dims.kv_heads),
                           ("MLP width", dims.intermediate), ("vocabulary", dims.vocab),
                           ("sequence length", layout.seq_length)]:
            if size % layout.tp:
                fail(f"--tp {layout.tp} does not divide the {what}, {size} (chapter 06 needs every split even)")
    if layout.cp > 1 and layout.seq_length % layout.cp:
        fail(f"--cp {layout.cp} does not divide --seq-length {layout.seq_length}")
    if layout.pp > 1 and layout.pp_schedule in V_SCHEDULES and (layout.pp_grad_reduce != "step"
                                                              or layout.activation_checkpointing):
        fail(f"--pp-schedule {layout.pp_schedule} splits each backward in two; use --pp-grad-reduce step, without "
             "--activation-checkpointing (chapter 08)")
    if layout.pp * layout.stages_per_rank > dims.layers:
        fail(f"--pp {layout.pp} makes {layout.pp * layout.stages_per_rank} stages, more than the model's "
             f"{dims.layers} decoder layers; use a smaller --pp"
             + (" or --pp-stages-per-rank" if layout.pp_schedule.startswith("interleaved") else ""))


def check_expert_layout(parameters, dims, layout):
    """Chapter 10's rules: expert parallelism on chapter 04's FSDP, whole experts per rank, FSDP2's even dim-1 split."""
    if layout.ep < 1:
        fail(f"--ep must be at least 1, got {layout.ep}")
    if not layout.fsdp:
        fail("--ep is chapter 10's expert parallelism, which shards with FSDP: add --fsdp")
    if layout.tp * layout.pp * layout.cp * layout.dp_replicate > 1 or layout.split_root_group:
        fail("--ep combines with --dp and --fsdp only (chapter 10 builds on chapter 04): drop --tp, --pp, --cp, "
             "--dp-replicate and --split-root-group")
    if layout.dp % layout.ep:
        fail(f"--ep {layout.ep} does not divide --dp {layout.dp}: the ranks form dp / ep groups of ep")
    if not dims.experts:
        if layout.ep > 1:
            fail(f"--ep {layout.ep} needs a mixture of experts: this model has no experts stored as 3D tensors "
                 "(mlp.experts.gate_up_proj, as Qwen3-MoE and Mixtral); use --ep 1 or leave it out")
        return
    if dims.experts % layout.ep:
        fail(f"--ep {layout.ep} does not divide the model's {dims.experts} experts (each rank holds whole experts)")
    for param in parameters:
        if param.role == "expert" and param.shape[1] % layout.edp:
            # NOTE: FSDP2 raises NotImplementedError for an uneven split of any dimension but the first.
            fail(f"{layout.edp} expert-data-parallel ranks (--dp / --ep) do not divide dim 1 of {param.name}, "
                 f"{param.shape}: FSDP2 shards the experts on dim 1 and needs it even; choose another --ep")


# ---------------------------------------------------------------------------------------------------------------------
# Where this rank sits


@dataclass
class Coordinates:
    """This rank's place on the mesh. NOTE: chapter 07's order, tp fastest (one node's GPUs), then the data-parallel
    dimensions; pipeline stages outermost and context parallelism next to tp until chapters 08 and 09 say otherwise."""

    pp: int
    replicate: int
    shard: int
    cp: int
    tp: int
    edp: int = 0                # chapter 10's mesh ("edp", "ep"), ep fastest, over the data-parallel ranks
    ep: int = 0


def rank_coordinates(layout):
    rank = layout.rank
    rank, tp = divmod(rank, layout.tp)
    rank, cp = divmod(rank, layout.cp)
    rank, shard = divmod(rank, layout.dp_shard)
    pp, replicate = divmod(rank, layout.dp_replicate)
    edp, ep = divmod(shard, layout.ep) if layout.ep else (0, 0)
    return Coordinates(pp=pp, replicate=replicate, shard=shard, cp=cp, tp=tp, edp=edp, ep=ep)


def stage_layers(dims, layout, pp_rank):
    """The decoder layers of a pipeline rank: its stages (rank_stages) of pp x stages per rank, as even a split as
    the layers allow, earlier stages taking the rest."""
    return split_layers(dims.layers, layout.pp, layout.stages_per_rank, pp_rank, layout.pp_schedule in V_SCHEDULES)


def rank_stages(pp, stages_per_rank, pp_rank, v_shape):
    """A pipeline rank's stages, as chapter 08 deals them: pp_rank, pp_rank + pp, ... round-robin, or in a V
    (pp_rank and 2 pp - 1 - pp_rank) for ZBV."""
    return (pp_rank, 2 * pp - 1 - pp_rank) if v_shape else range(pp_rank, pp * stages_per_rank, pp)


@functools.lru_cache
def split_layers(num_layers, pp, stages_per_rank, pp_rank, v_shape=False):
    # NOTE: cached: every parameter asks whether its layer is on the rank (tools/plan_layout.py, thousands of layouts).
    num_stages = pp * stages_per_rank
    per_stage, extra = divmod(num_layers, num_stages)
    starts = [stage * per_stage + min(stage, extra) for stage in range(num_stages + 1)]
    return frozenset(layer for stage in rank_stages(pp, stages_per_rank, pp_rank, v_shape)
                     for layer in range(starts[stage], starts[stage + 1]))


def on_this_stage(param, dims, layout, stage):
    if layout.pp == 1:
        return True
    if param.layer is not None:
        return param.layer in stage_layers(dims, layout, stage)
    if param.role == "embedding":
        return stage == 0 or (dims.tied and stage == layout.last_stage_rank)
    return stage == layout.last_stage_rank


# ---------------------------------------------------------------------------------------------------------------------
# Sizes of one rank's pieces


def chunk_length(length, parts, index):
    """The length of torch.chunk(tensor of this length, parts)[index]: what DTensor's Shard and FSDP2 keep."""
    size = -(-length // parts)
    return max(0, min(size, length - index * size))


def tp_local_shape(param, layout, coords):
    """The shape of this rank's slice under chapter 06's plan; the gradient's local shape is returned too.

    NOTE: in torch 2.13 the embedding's gradient arrives as a Replicate DTensor, the full table, and the norms'
    gradients as Partial ones, full-sized on every rank (chapter 06's README): the gradient can be bigger than the
    parameter it belongs to.
    """
    shape = list(param.shape)
    if layout.tp == 1:
        return tuple(shape), tuple(shape)
    full = tuple(shape)
    if param.role in ("colwise", "head", "embedding"):
        shape[0] = chunk_length(shape[0], layout.tp, coords.tp)
    elif param.role == "rowwise":
        shape[1] = chunk_length(shape[1], layout.tp, coords.tp)
    local = tuple(shape)
    grad = full if param.role in ("embedding", "norm") else local
    return local, grad


def fsdp_local_shape(shape, layout, coords):
    """FSDP2 keeps the rows chunk(dim 0, shards)[shard] of the (tensor-parallel) local tensor."""
    if not layout.fsdp or layout.fsdp_shards == 1 or not shape:
        return tuple(shape)
    return (chunk_length(shape[0], layout.fsdp_shards, coords.shard * layout.cp + coords.cp), *shape[1:])


def fsdp_padded_numel(shape, layout):
    """The elements FSDP2 all-gathers and reduce-scatters for a parameter: dim 0 padded to a multiple of the shards."""
    rows = -(-shape[0] // layout.fsdp_shards) * layout.fsdp_shards if shape else 1
    return rows * math.prod(shape[1:])


def expert_parallel(param, layout):
    """Whether chapter 10 shards this parameter as an expert: E/ep whole experts, dim 1 over the edp ranks."""
    return param.role == "expert" and layout.ep is not None


def expert_local_shape(shape, layout, coords):
    """This rank's experts (dim 0 split over ep, whole experts), FSDP2's Shard(1) of them over the edp ranks."""
    experts = chunk_length(shape[0], layout.ep, coords.ep)
    return (experts, chunk_length(shape[1], layout.edp, coords.edp), *shape[2:])


def expert_padded_numel(shape, layout):
    """What FSDP2 all-gathers of this rank's experts over the edp ranks: dim 1 padded to a multiple of them."""
    return shape[0] // layout.ep * -(-shape[1] // layout.edp) * layout.edp * math.prod(shape[2:])


def numel(shape):
    return math.prod(shape)


def zero1_partition(parameters, world_size):
    """The parameter indices each rank of ZeroRedundancyOptimizer updates: largest first, each to the rank that holds
    the fewest elements so far (torch's _partition_parameters), so the estimate matches it exactly."""
    sizes = [0] * world_size
    owners = {}
    for index in sorted(range(len(parameters)), key=lambda i: numel(parameters[i].shape), reverse=True):
        rank = sizes.index(min(sizes))
        owners[index] = rank
        sizes[rank] += numel(parameters[index].shape)
    return owners


# ---------------------------------------------------------------------------------------------------------------------
# The estimate


def estimate_step(config, layout):
    """Everything the tool reports, as one dict of plain numbers (the --json output)."""
    parameters = model_parameters(config)
    dims = model_dimensions(config, parameters)
    check_layout(parameters, dims, layout)
    coords = rank_coordinates(layout)
    state = model_state(parameters, dims, layout, coords)
    widths = byte_widths(layout)
    activations = activation_model(dims, layout, coords, widths)
    groups = fsdp_groups(parameters, dims, layout, coords)
    peak = simulate_step(state, activations, groups, dims, layout, widths)
    if layout.reduces_once_per_step:
        # NOTE: --pp-grad-reduce step: every group's whole fp32 gradients stay until the step's end, beside the
        # micro-batches still in flight: 1F1B's steady state, the drain's second backward, or a lone micro-batch's.
        in_flight = activations["in_flight"]
        later = in_flight if layout.grad_accum > in_flight else max(1, in_flight - 1)
        steady = activation_model(dims, layout, coords, widths, in_flight=later)
        later_step = simulate_step(state, steady, groups, dims, layout, widths,
                                   full_size_gradients(groups, state, layout))
        peak = max(peak, later_step, key=lambda result: result["above_start_bytes"])
    comm = communication(parameters, dims, layout, coords, groups, widths, model_buffer_bytes(config))
    return {
        "model": getattr(config, "name_or_path", "") or config.model_type,
        "num_parameters": sum(numel(p.shape) for p in parameters),
        "num_expert_parameters": sum(numel(p.shape) for p in parameters if p.role == "expert"),
        # NOTE: what one token computes with: every parameter but the experts it is not routed to.
        "num_active_parameters": sum(numel(p.shape) * (dims.top_k / dims.experts if p.role == "expert" else 1)
                                     for p in parameters),
        "experts": {"per_layer": dims.experts, "top_k": dims.top_k, "moe_layers": len(dims.moe_layers),
                    "per_rank": dims.experts // (layout.ep or 1)},
        "layout": asdict(layout),
        "world_size": layout.world_size,
        "pipeline_bubble": pipeline_bubble(layout.pp, layout.grad_accum, layout.pp_stages_per_rank),
        "params_bytes": state["params_bytes"],
        "grads_bytes": state["grads_bytes"],
        "optimizer_bytes": state["optimizer_bytes"],
        "expert_params_bytes": state["expert_params_bytes"],
        "cpu_bytes": state["cpu_bytes"],
        "activations_bytes": activations["saved_bytes"],
        "activations_at_peak_bytes": peak["activations_at_peak_bytes"],
        "gathered_weights_bytes": gathered_weights(groups, layout),
        "full_size_grads_peak_bytes": full_size_gradients(groups, state, layout),
        "transient_bytes": peak["transient_bytes"],
        "step_peak_above_start_bytes": peak["above_start_bytes"],
        "peak_bytes": peak["peak_bytes"],
        "peak_phase": peak["phase"],
        "comm_bytes_per_step": sum(group["sent_bytes"] for group in comm.values()),
        "comm_by_group": comm,
    }


def model_state(parameters, dims, layout, coords):
    """Bytes of this rank's parameters, gradients and AdamW state, all fp32 as in every chapter."""
    owners = zero1_partition(parameters, layout.dp) if layout.zero1 or layout.zero2 else None
    params = grads = optimizer = experts = 0
    for index, param in enumerate(parameters):
        if not on_this_stage(param, dims, layout, coords.pp):
            continue
        local, grad = tp_local_shape(param, layout, coords)
        local = (expert_local_shape(param.shape, layout, coords) if expert_parallel(param, layout)
                 else fsdp_local_shape(local, layout, coords))
        # NOTE: FSDP reduce-scatters every gradient into the shape of its parameter's shard.
        grad = local if layout.fsdp else grad
        mine = owners is None or owners[index] == coords.shard
        params += 4 * numel(local)
        grads += 4 * numel(grad) if not layout.zero2 or mine else 0
        optimizer += 8 * numel(local) if mine else 0
        experts += 4 * numel(local) if param.role == "expert" else 0
    cpu = 0
    if layout.cpu_offload:
        cpu, params, grads, optimizer = params + grads + optimizer, 0, 0, 0
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer, "cpu_bytes": cpu,
            "expert_params_bytes": experts}


def byte_widths(layout):
    """Bytes per element of what a step computes, by where it lives.

    NOTE: three regimes. In float32 everything is 4 bytes. Chapters 01-03 and 06 compute in bf16 with autocast: the
    weights and the residual stream stay fp32, matmul outputs and attention are bf16. The FSDP chapters (04, 05 and
    07 to 11) use FSDP's MixedPrecisionPolicy: the gathered weights are bf16, and so is everything computed from
    them, except inside the RMSNorms (fp32) and the loss (fp32).
    """
    if layout.dtype == "float32":
        return {"residual": 4, "norm": 4, "matmul": 4, "attention": 4, "weights": 4, "loss": 4, "grads": 4}
    if layout.fsdp:
        return {"residual": 2, "norm": 4, "matmul": 2, "attention": 2, "weights": 2, "loss": 4, "grads": 2}
    return {"residual": 4, "norm": 4, "matmul": 2, "attention": 2, "weights": 4, "loss": 4, "grads": 4}


def activation_model(dims, layout, coords, widths, in_flight=None):
    """Bytes autograd keeps between forward and backward, per decoder layer and for the rest of the model.

    Per token of a Llama-style decoder layer (sdpa or flash attention, which never store the s x s scores), with
    t the tensor-parallel degree; each RMSNorm keeps its input, its normalized value and the tensor the next
    matmuls read (all-gathered, whole, under sequence parallelism); attention keeps q, k, v and its output (the
    output projection reads that same storage); the SwiGLU MLP keeps gate, silu(gate), up and their product.

    A mixture of experts' MLP: moe_mlp_bytes_per_token.
    """
    t, w = layout.tp, widths
    h, q, kv, i = dims.hidden, dims.q_dim, dims.kv_dim, dims.intermediate
    if layout.fsdp and layout.dtype != "float32":
        # NOTE: bf16 input: the norm's fp32 copy of it, its bf16 normalized value, the bf16 matmul input.
        norm = (w["norm"] + w["matmul"]) * h / t + w["matmul"] * h
    else:
        norm = (w["residual"] + w["norm"]) * h / t + w["matmul"] * h
    attention = w["attention"] * (2 * q + 2 * kv) / t + 4 * dims.heads / t
    mlp = w["matmul"] * 4 * i / t
    moe_mlp = moe_mlp_bytes_per_token(dims, w)
    small = 2 * 4 / t  # the norms' reciprocal square roots, one fp32 per token each
    per_token_layer = 2 * norm + attention + mlp + small
    tokens = layout.batch_size * layout.seq_length // layout.cp
    dense_layer_bytes = per_token_layer * tokens
    moe_layer_bytes = (per_token_layer - mlp + moe_mlp) * tokens
    layer_input = w["residual"] * h / t * tokens
    layers = stage_layers(dims, layout, coords.pp) if layout.pp > 1 else range(dims.layers)
    num_layers = len(layers)
    num_moe_layers = sum(layer in layers for layer in dims.moe_layers)
    layer_bytes = moe_layer_bytes if num_moe_layers else dense_layer_bytes
    is_last_stage = coords.pp == layout.last_stage_rank
    # NOTE: under TP the embedding's output is whole (Replicate); layer 0 keeps a slice of it, a view that keeps
    # the whole storage alive.
    embedding = (w["residual"] * h * (1 - 1 / t) * tokens) if 0 in layers and t > 1 else 0
    final_norm = norm * tokens if is_last_stage else 0
    vocab_local = dims.vocab / t
    # NOTE: the loss keeps log_softmax's fp32 output; its backward holds two more fp32 logits-sized tensors, measured
    # on CPUs. Split along the vocabulary (tp > 1) it keeps the fp32 softmax, and its backward turns that into the
    # gradient in place, copied to the logits' dtype (VocabParallelCrossEntropy).
    loss_saved = w["loss"] * vocab_local * tokens if is_last_stage else 0
    backward_bytes = (w["matmul"] if w["matmul"] != w["loss"] else 0) if t > 1 else 2 * w["loss"]
    loss_backward = backward_bytes * vocab_local * tokens if is_last_stage else 0
    rotary = 2 * w["residual"] * layout.seq_length // layout.cp * dims.head_dim
    if in_flight is None:
        in_flight = IN_FLIGHT[layout.pp_schedule](layout.pp, coords.pp, layout.grad_accum, layout.stages_per_rank) \
            if layout.pp > 1 else 1
    if layout.activation_checkpointing:
        saved_layers = num_layers * layer_input
    else:
        saved_layers = (num_layers - num_moe_layers) * dense_layer_bytes + num_moe_layers * moe_layer_bytes
    saved = (saved_layers + embedding + rotary) * in_flight + final_norm + loss_saved
    return {"saved_bytes": saved, "layer_bytes": layer_bytes, "layer_input_bytes": layer_input,
            "num_layers": num_layers, "num_moe_layers": num_moe_layers, "loss_saved_bytes": loss_saved,
            "loss_backward_bytes": loss_backward, "final_norm_bytes": final_norm, "in_flight": in_flight,
            "largest_layer_tensor_bytes": max(w["matmul"] * i / t, w["residual"] * h) * tokens if not num_moe_layers
            else w["matmul"] * dims.top_k * max(h, 2 * dims.moe_intermediate) * tokens, "tokens": tokens}


# The micro-batches whose activations a pipeline rank holds at once, in passes through all its layers, by schedule:
# (stages p, this rank r, micro-batches m a step). NOTE: 1F1B's warm-up runs p - r forwards before the first
# backward; interleaved 1F1B (torch's _get_warmup_ops) runs (v - 1) x R + 2 (p - 1 - r) + 1 chunks of 1/v (v stages
# a rank), with R = m / (its rounds, m // p or 1) micro-batches a round, at most all v x m. ZBV's two stages hold
# 2p stage-micro-batches at the peak (2p - r - 1 of the first and r + 1 of the second, or 2p - r and r - 1), fewer
# at m < 2p - 1, counted in halves of the rank's layers. Each counted on torch's own schedules in
# tests/test_estimate_memory.py.
IN_FLIGHT = {"gpipe": lambda p, r, m, v: m, "1f1b": lambda p, r, m, v: min(p - r, m),
             "interleaved-1f1b": lambda p, r, m, v: min((v - 1) * (m // max(1, m // p)) + 2 * (p - 1 - r) + 1,
                                                       v * m) / v,
             "zbv": lambda p, r, m, v: (min(2 * p - r - 1, m) + min(r + 1, m)) / 2}
# NOTE: ZBV holds a rank's two stages in a V (r and 2p - 1 - r): the first and the last stage on rank 0.
V_SCHEDULES = ("zbv",)


def moe_mlp_bytes_per_token(dims, widths):
    """What a dropless top-k mixture of experts' MLP keeps for backward, per token: the router's logits and their
    fp32 softmax (experts wide), and per routed copy (top_k of them) the token's copy the expert reads, gate and up
    (one tensor), silu(gate), their product, the expert's output (which the routing weight multiplies), the weighted
    output (the scatter-add back into the token keeps it), the copy's weight and three int64 indices.

    NOTE: the tests hold it to what transformers' own loop over the experts (Qwen3MoeSparseMoeBlock) saves, within
    2%, and chapter 10's all-to-all path through its step peak, measured by tools/measure_step.py, within 15%.
    """
    w = widths["matmul"]
    router = (w + 4) * dims.experts
    return router + dims.top_k * (w * (3 * dims.hidden + 4 * dims.moe_intermediate + 1) + 3 * 8)


@dataclass
class Group:
    """An FSDP group (or, without FSDP, the whole model as one): what a step gathers and reduces of it."""

    name: str
    layer: int | None
    full_bytes: int = 0         # the unsharded parameters in the compute dtype, on this rank (its tp slice)
    padded_numel: int = 0       # what the all-gather and reduce-scatter carry, dim 0 padded
    grad_full_bytes: int = 0    # the unsharded gradients in the compute dtype
    reshard_after_forward: bool = True
    params: list = field(default_factory=list)
    shards: int = 1             # the ranks FSDP shards it over (chapter 10's experts: the edp ranks)
    parts: list = field(default_factory=list)  # a decoder layer's groups, for layer_units()

    @property
    def sharded_grad_bytes(self):
        return sum(4 * g.padded_numel // g.shards for g in self.parts or [self])

    @property
    def reduce_peak_bytes(self):
        """The most a post-backward holds: a group's unsharded gradients and the reduce-scatter's fp32 input and
        output (one group at a time, chapter 10's experts before the rest of their layer)."""
        return max(g.grad_full_bytes + 4 * g.padded_numel * (1 + 1 / g.shards) for g in self.parts or [self])


def fsdp_groups(parameters, dims, layout, coords):
    """Chapter 04's groups (one per decoder layer, the root with the rest), or chapter 05's with --split-root-group."""
    widths = byte_widths(layout)
    groups = {}
    for param in parameters:
        if not on_this_stage(param, dims, layout, coords.pp):
            continue
        if param.layer is not None:
            key = f"layer {param.layer}" + (" experts" if expert_parallel(param, layout) else "")
        elif layout.split_root_group and param.role == "embedding" and not dims.tied:
            key = "embedding"
        elif layout.split_root_group:
            key = "norm and head"
        else:
            key = "root"
        expert = expert_parallel(param, layout)
        group = groups.setdefault(key, Group(key, param.layer, shards=layout.edp if expert else layout.fsdp_shards))
        local, grad = tp_local_shape(param, layout, coords)
        if expert:
            # NOTE: this rank's experts, whole: what the edp ranks' all-gather rebuilds.
            local = grad = (local[0] // layout.ep, *local[1:])
        group.params.append(param)
        group.full_bytes += widths["weights"] * numel(local)
        group.grad_full_bytes += widths["grads"] * numel(grad)
        group.padded_numel += (expert_padded_numel(param.shape, layout) if expert else
                               fsdp_padded_numel(local, layout) if layout.fsdp else numel(local))
    layers = [g for g in groups.values() if g.layer is not None]
    if layers:
        # NOTE: chapter 04 keeps its last layer gathered for backward; chapter 10 that layer's experts too.
        last = max(g.layer for g in layers)
        for group in layers:
            group.reshard_after_forward = group.layer != last
    for name in ("root", "norm and head"):
        if name in groups:
            groups[name].reshard_after_forward = False
    # NOTE: chapter 08 keeps a stage's layers gathered from their first forward to the end of the step with pp > 1.
    for group in groups.values():
        group.reshard_after_forward = group.reshard_after_forward and layout.pp == 1
    return groups


def layer_units(groups):
    """Each decoder layer's FSDP groups as one, in layer order: gathered together for the layer's forward and
    backward (chapter 10's experts group sits inside its layer's)."""
    units = {}
    for group in groups.values():
        if group.layer is None:
            continue
        unit = units.setdefault(group.layer, Group(f"layer {group.layer}", group.layer,
                                                   reshard_after_forward=group.reshard_after_forward))
        unit.full_bytes += group.full_bytes
        unit.grad_full_bytes += group.grad_full_bytes
        unit.parts.append(group)
    return [units[layer] for layer in sorted(units)]


def gathered_weights(groups, layout):
    """FSDP's whole weights in the compute dtype at a time: the largest layer and the next one, prefetched, and
    the groups kept gathered from forward to backward (chapter 04's root group). Zero without FSDP."""
    if not layout.fsdp:
        return 0
    if layout.pp > 1:
        return sum(g.full_bytes for g in groups.values())
    layers = sorted((unit.full_bytes for unit in layer_units(groups)), reverse=True)
    kept = sum(g.full_bytes for g in groups.values() if g.layer is None and not g.reshard_after_forward)
    return sum(layers[:2]) + kept


def simulate_step(state, activations, groups, dims, layout, widths, accumulated_override=None):
    """The most memory a step holds above what it held when it started, from a walk through its phases.

    The phases: the start of backward (everything forward saved, the loss's gradients, the groups still
    gathered); the backward of each decoder layer, last first (the activations of the layers before it, its
    own, recomputed with activation checkpointing, its gathered weights and the next one's prefetched, its
    unsharded gradients and the reduce-scatter's fp32 buffer, the gradients of the layers done so far); the end of
    backward (every gradient). The few constants below that are not sizes of tensors were measured on CPUs with
    tools/measure_step.py; the tests hold the result within 15% of the measured peak.
    """
    fsdp = layout.fsdp
    # NOTE: DDP's gradients are views into its buckets, allocated when the model is wrapped: they exist before
    # the step. Every other chapter frees them after the optimizer step (zero_grad(set_to_none=True)).
    grads_exist_at_start = layout.dp > 1 and not fsdp and not layout.zero2
    # NOTE: with gradient accumulation the last micro-batch's backward runs with every (sharded) gradient there.
    accumulated = state["grads_bytes"] if layout.grad_accum > 1 and not grads_exist_at_start else 0
    if accumulated_override is not None:
        accumulated = accumulated_override
    layer_groups = layer_units(groups)
    other_groups = [g for g in groups.values() if g.layer is None]
    kept_gathered = sum(g.full_bytes for g in groups.values() if fsdp and not g.reshard_after_forward)
    if fsdp and layout.pp > 1 and "root" in groups and not layout.reduces_once_per_step:
        # NOTE: chapter 08's backwards are not FSDP's last of the step: the root group's fp32 reduce-scatter input
        # stays until the next backward's first reduction (FSDP frees it at the step's last backward only).
        kept_gathered += 4 * groups["root"].padded_numel

    def sharded_grad(group):
        if not fsdp:
            return group.grad_full_bytes * 4 // widths["grads"]
        return group.sharded_grad_bytes

    phases, alive = {}, {}
    saved = activations["saved_bytes"]
    phases["start of backward"] = saved + activations["loss_backward_bytes"] + kept_gathered
    alive["start of backward"] = saved
    grads_done = accumulated or (0 if grads_exist_at_start else head_gradients(other_groups, layout, widths))
    layer_activations = activations["layer_bytes"] * activations["in_flight"]
    kept = activations["layer_input_bytes"] if layout.activation_checkpointing else layer_activations
    # NOTE: a layer recomputed under activation checkpointing holds about a quarter more than its saved tensors
    # while its backward runs (the recomputed forward's outputs, one micro-batch's), measured on CPUs.
    own = activations["layer_bytes"] * 1.25 if layout.activation_checkpointing else layer_activations
    # NOTE: in a checkpointed pipeline stage the other micro-batches in flight keep every layer's input.
    stage_inputs = saved - activations["final_norm_bytes"] - activations["loss_saved_bytes"]
    checkpointed_stage = layout.activation_checkpointing and layout.pp > 1
    flowing = 3 * activations["largest_layer_tensor_bytes"]
    down_grad = widths["grads"] * dims.hidden * dims.intermediate / layout.tp
    if dims.moe_layers:
        # NOTE: in a mixture of experts, the first weight gradient is the down projections of this rank's experts.
        down_grad = widths["grads"] * dims.hidden * dims.moe_intermediate * dims.experts // (layout.ep or 1)
    embedding_group = groups.get("embedding")
    for position, group in enumerate(reversed(layer_groups)):
        below = len(layer_groups) - 1 - position
        live_below = stage_inputs - (position + 1) * kept if checkpointed_stage else below * kept
        gathered = 0
        if fsdp:
            # NOTE: this layer's weights, the next layer's prefetched (the embedding's, after layer 0, when it is a
            # group of its own), and any group kept whole for the step (chapter 04's root group).
            prefetched = layer_groups[below - 1] if below > 0 else embedding_group
            gathered = group.full_bytes + (prefetched.full_bytes if prefetched else 0)
            gathered += sum(g.full_bytes for g in other_groups if not g.reshard_after_forward and g.name == "root")
            gathered = kept_gathered if layout.pp > 1 else gathered
        # In the middle of the layer's backward: its activations, the gradients flowing through it, the first
        # weight gradient (the MLP's down projection).
        middle = live_below + own + flowing + down_grad + gathered + grads_done
        # At its end: its whole gradients (with FSDP, unsharded, copied into the reduce-scatter's fp32 buffer).
        if fsdp:
            # NOTE: measured on CPUs: the layer's gathered weights are still there while its gradients are copied
            # into the reduce-scatter's buffer.
            # NOTE: under --pp-grad-reduce step no layer reduces in backward: its whole fp32 gradients, already
            # counted in grads_done, are added into the accumulated ones.
            reduced = 0 if layout.reduces_once_per_step else group.reduce_peak_bytes
            end = live_below + reduced + gathered + grads_done
        else:
            own_grads = 0 if grads_exist_at_start or accumulated else group.grad_full_bytes
            end = live_below + own_grads + grads_done + flowing / 3
        phases[f"backward of layer {group.layer}"] = max(middle, end)
        # NOTE: in a pipeline stage the other micro-batches keep what forward saved (as the dry run of 08's 70B does).
        alive[f"backward of layer {group.layer}"] = (live_below + own if checkpointed_stage else saved) \
            if layout.pp > 1 else live_below + (own if middle >= end else 0)
        grads_done += 0 if grads_exist_at_start or accumulated else sharded_grad(group)
    # The end of backward: every gradient, and the one arriving at the embedding (whole under TP); with FSDP the
    # last group's unsharded gradients and its reduce-scatter buffers (chapter 04's root group, chapter 05's
    # embedding).
    into_embedding = widths["residual"] * dims.hidden * activations["tokens"]
    if fsdp:
        last = groups.get("embedding") or groups.get("root")
        if last is not None:
            others = accumulated or sum(sharded_grad(g) for g in groups.values() if g is not last)
            # NOTE: under --pp-grad-reduce step the last group's whole gradients are among the accumulated ones.
            own = 0 if layout.reduces_once_per_step else last.grad_full_bytes
            # NOTE: the other micro-batches in flight hold their saved layer inputs. Counted when checkpointed (11's
            # 405B dry run); without it the dry runs peak in the last layer's backward, this phase 1% below (08's 70B).
            waiting = stage_inputs * (activations["in_flight"] - 1) / activations["in_flight"] \
                if checkpointed_stage else 0
            # NOTE: under --pp-grad-reduce step only the step's last backward, none waiting, reduce-scatters.
            reduced = 0 if layout.reduces_once_per_step and waiting else \
                4 * last.padded_numel * (1 + 1 / layout.fsdp_shards)
            phases["end of backward"] = (waiting + others + own + (kept_gathered if layout.pp > 1 else 0) + reduced
                                         + into_embedding)
            alive["end of backward"] = waiting
    elif not grads_exist_at_start:
        phases["end of backward"] = state["grads_bytes"] + into_embedding
    phase, above_start = max(phases.items(), key=lambda item: item[1])
    at_start = (state["params_bytes"] + state["optimizer_bytes"]
                + (state["grads_bytes"] if grads_exist_at_start else 0))
    # NOTE: the activations still alive in the peak's phase: in a layer's backward, the loss's and the later
    # layers' are freed.
    transient = above_start - alive.get(phase, 0)
    return {"above_start_bytes": round(above_start), "transient_bytes": round(transient),
            "peak_bytes": round(at_start + above_start), "phase": phase,
            "activations_at_peak_bytes": round(alive.get(phase, 0))}


def full_size_gradients(groups, state, layout):
    """The most bytes of full-size (unsharded) gradients alive at once in a step: tools/measure_step.py's
    peak_full_size_grad_bytes.

    NOTE: with FSDP a group's gradients are whole from the backward that computes them until the group's post-backward
    reduce-scatters them, in every micro-batch (chapter 08 included). The root group's wait for the embedding's, the
    last to come: the head's and final norm's stay whole while each layer's come and go. Without FSDP every gradient
    is whole until the optimizer step; under TP they are DTensors, which the meter does not count.
    """
    if not layout.fsdp:
        return state["grads_bytes"] if layout.tp == 1 else 0
    layers = [g.grad_full_bytes for g in groups.values() if g.layer is not None]
    root = groups.get("root")
    coords, width = rank_coordinates(layout), byte_widths(layout)["grads"]
    if root is None:  # chapter 05's groups: each reduce-scattered as soon as its own backward is done
        per_backward = max(layers + [g.grad_full_bytes for g in groups.values()])
    else:
        embedding = sum(width * numel(tp_local_shape(p, layout, coords)[1])
                        for p in root.params if p.role == "embedding")
        per_backward = root.grad_full_bytes - embedding + max(layers + [embedding])
    if layout.reduces_once_per_step:
        # NOTE: in bf16 a backward's own whole gradients come on top of the fp32 sum until they are added in.
        return accumulated_full_gradients(groups, byte_widths(layout)) + (per_backward if width != 4 else 0)
    return per_backward


def accumulated_full_gradients(groups, widths):
    """--pp-grad-reduce step: every FSDP group's whole gradients, summed in fp32 until the step's last backward."""
    return sum(g.grad_full_bytes for g in groups.values()) * 4 // widths["grads"]


def head_gradients(other_groups, layout, widths):
    """The gradients of the final norm and the output head, which backward computes first, as they wait for the
    decoder layers' backward: whole, until the end of backward, in chapter 04's root group (reduce-scattered with
    the embedding's); already sharded in chapter 05's group of their own; whole, in fp32, without FSDP. The
    embedding's gradient comes last."""
    total = 0
    coords = rank_coordinates(layout)
    for group in other_groups:
        for param in group.params:
            if param.role == "embedding":
                continue
            local, grad = tp_local_shape(param, layout, coords)
            if not layout.fsdp:
                total += 4 * numel(grad)
            elif group.reshard_after_forward or group.name != "root":
                total += 4 * fsdp_padded_numel(local, layout) // layout.fsdp_shards
            else:
                total += widths["grads"] * numel(local)
    return total


def communication(parameters, dims, layout, coords, groups, widths, buffer_bytes=0):
    """Bytes this rank sends per step, per process group, by kind of collective (the convention of measure_step)."""
    comm = {}

    def add(group_name, group_size, kind, buffer_bytes, calls=1):
        if group_size <= 1 or buffer_bytes == 0:
            return
        entry = comm.setdefault(group_name, {"group_size": group_size, "sent_bytes": 0.0, "collectives": {}})
        sent = bytes_sent(kind, buffer_bytes, group_size) * calls
        counts = entry["collectives"].setdefault(kind, {"calls": 0, "buffer_bytes": 0, "sent_bytes": 0.0})
        counts["calls"] += calls
        counts["buffer_bytes"] += buffer_bytes * calls
        counts["sent_bytes"] += sent
        entry["sent_bytes"] += sent

    micro_batches = layout.grad_accum
    stage_parameters = [p for p in parameters if on_this_stage(p, dims, layout, coords.pp)]
    local_numel = sum(numel(tp_local_shape(p, layout, coords)[0]) for p in stage_parameters)
    data_parallel = layout.dp * layout.cp  # NOTE: context-parallel ranks hold the same weights, like data-parallel ones
    if layout.fsdp:
        shard_group = layout.fsdp_shards
        for group in groups.values():
            gathered = widths["weights"] * group.padded_numel
            # NOTE: with pp > 1 chapter 08 gathers each group once per step and keeps it (reshard_after_backward off).
            gathers = (1 + group.reshard_after_forward) * micro_batches if layout.pp == 1 else 1
            name = "edp (experts' FSDP)" if group.name.endswith("experts") else "dp (FSDP)"
            add(name, group.shards, "all_gather", gathered, calls=gathers)
            reduces = 1 if layout.reduces_once_per_step else micro_batches
            add(name, group.shards, "reduce_scatter", 4 * group.padded_numel, calls=reduces)
            # NOTE: chapter 07 all-reduces the replicas' gradient shards in a step's last backward (offloaded: in each).
            add("dp replicas (HSDP)", layout.dp_replicate, "all_reduce", 4 * group.padded_numel // shard_group,
                calls=micro_batches if layout.cpu_offload else 1)
        # NOTE: clip_grad_norm_ all-reduces the stacked partial norms of the parameters, one fp32 number each.
        add("dp (FSDP)", shard_group, "all_reduce", 4 * len(stage_parameters))
    else:
        # NOTE: DDP all-reduces the fp32 gradients once per step (no_sync() skips the other micro-batches).
        add("dp (DDP)", data_parallel, "all_reduce", 4 * local_numel)
        # NOTE: and broadcasts rank 0's buffers (the rotary frequencies) at every forward.
        add("dp (DDP)", data_parallel, "broadcast", buffer_bytes, calls=micro_batches)
        if layout.zero1 or layout.zero2:
            # NOTE: ZeroRedundancyOptimizer broadcasts each rank's updated parameters to the others.
            add("dp (DDP)", data_parallel, "broadcast", 4 * local_numel)
    if layout.tp > 1:
        tensor_parallel_collectives(add, dims, layout, coords, parameters, widths, micro_batches)
    if layout.ep and dims.moe_layers:
        # NOTE: chapter 10 sends each token's top_k copies to the ranks of their experts and back, in forward and
        # again (their gradients) in backward: four all_to_all_single per MoE layer and micro-batch, dropless. The
        # exchange of the split sizes (ep integers) is left out.
        routed = widths["matmul"] * layout.batch_size * layout.seq_length * dims.top_k * dims.hidden
        add("ep (all-to-all)", layout.ep, "all_to_all", routed, calls=4 * len(dims.moe_layers) * micro_batches)
    if layout.cp > 1:
        tokens = layout.batch_size * layout.seq_length // layout.cp
        key_value_block = 2 * dims.kv_dim / layout.tp * tokens  # this rank's keys and values, in numbers
        num_layers = len(stage_layers(dims, layout, coords.pp))
        # NOTE: chapter 09's ring (--cp-attention ring, its default) passes each rank's K/V block to the next rank
        # cp - 1 times in forward and again in backward, and the blocks' fp32 gradients cp times (the last pass
        # brings each rank's own home): point-to-point sends, per layer and micro-batch.
        add("cp (ring attention)", layout.cp, "send", widths["attention"] * key_value_block,
            calls=2 * (layout.cp - 1) * num_layers * micro_batches)
        add("cp (ring attention)", layout.cp, "send", 4 * key_value_block, calls=layout.cp * num_layers * micro_batches)
    if layout.pp > 1:
        tokens = layout.batch_size * layout.seq_length // layout.cp
        boundary = widths["residual"] * dims.hidden / layout.tp * tokens
        # NOTE: each of this rank's stages sends activations forward and their gradients backward, but at the ends
        # and to a stage on the same rank (the V's turn).
        num_stages = layout.pp * layout.stages_per_rank
        held = rank_stages(layout.pp, layout.stages_per_rank, coords.pp, layout.pp_schedule in V_SCHEDULES)
        sends = sum((stage < num_stages - 1 and stage + 1 not in held) + (stage > 0 and stage - 1 not in held)
                    for stage in held)
        add("pp (stage to stage)", 2, "send", boundary, calls=sends * micro_batches)
        # NOTE: the gradient norm of the whole model: the stages' squared norms summed, one fp32 number.
        add("pp (stage to stage)", layout.pp, "all_reduce", 4)
    return comm


def tensor_parallel_collectives(add, dims, layout, coords, parameters, widths, micro_batches):
    """Chapter 06's collectives per micro-batch, each of a (batch, sequence, hidden) activation.

    Per decoder layer, forward: all-gather of the norm's output before attention and before the MLP, and a
    reduce-scatter of each block's output (row-wise partial sums); backward: the same four the other way round.
    The gathered tensors are the norms' outputs (residual dtype); the reduced ones come out of matmuls.
    """
    t = layout.tp
    tokens = layout.batch_size * layout.seq_length // layout.cp
    activation = dims.hidden * tokens
    residual, matmul = widths["residual"], widths["matmul"]
    num_layers = len(stage_layers(dims, layout, coords.pp))
    gathered = residual * activation
    reduced = matmul * activation
    per_layer = [("all_gather", gathered, 2), ("reduce_scatter", reduced, 2),      # forward
                 ("reduce_scatter", gathered, 2), ("all_gather", reduced, 2)]      # backward
    for kind, buffer_bytes, calls in per_layer:
        add("tp", t, kind, buffer_bytes, calls=calls * num_layers * micro_batches)
    first_stage, last_stage = coords.pp == 0, coords.pp == layout.last_stage_rank
    if first_stage:
        # NOTE: the embedding's partial lookups are summed whole (Replicate), in the embedding's dtype; in backward
        # layer 0's input slice is all-gathered back.
        add("tp", t, "all_reduce", widths["weights"] * activation, calls=micro_batches)
        add("tp", t, "all_gather", gathered, calls=micro_batches)
    if last_stage:
        # NOTE: the head reads the final norm's output whole: all-gathered in forward, reduce-scattered in backward.
        add("tp", t, "all_gather", gathered, calls=micro_batches)
        add("tp", t, "reduce_scatter", gathered, calls=micro_batches)
        # NOTE: the loss of split logits: the largest logit per token, then its sum of exponentials and label's logit.
        add("tp", t, "all_reduce", 4 * tokens, calls=micro_batches)
        add("tp", t, "all_reduce", 8 * tokens, calls=micro_batches)
    # NOTE: the norms' gradients are Partial: all-reduced by clip_grad_norm_, and without FSDP once more by the fused
    # AdamW, which reads each gradient once. clip_grad_norm_ then all-reduces the stacked norms, one number each.
    stage_parameters = [p for p in parameters if on_this_stage(p, dims, layout, coords.pp)]
    norm_bytes = sum(4 * numel(p.shape) for p in stage_parameters if p.role == "norm")
    add("tp", t, "all_reduce", norm_bytes, calls=1 if layout.fsdp else 2)
    add("tp", t, "all_reduce", 4 * len(stage_parameters))


# ---------------------------------------------------------------------------------------------------------------------
# Output


def print_estimate(estimate, bandwidths):
    layout = estimate["layout"]
    flags = describe_layout(layout)
    print(f"{estimate['model']}: {estimate['num_parameters'] / 1e9:.3g}B parameters; {flags}; world size "
          f"{estimate['world_size']}; rank {layout['rank']}")
    experts = estimate["experts"]
    if experts["per_layer"]:
        print(f"a mixture of experts: {experts['per_layer']} experts in each of {experts['moe_layers']} layers, "
              f"{experts['top_k']} per token: {estimate['num_active_parameters'] / 1e9:.3g}B active parameters of "
              f"{estimate['num_parameters'] / 1e9:.3g}B ({estimate['num_expert_parameters'] / 1e9:.3g}B in experts); "
              f"{experts['per_rank']} experts per GPU")
    print(f"micro-batch {layout['batch_size']} x {layout['seq_length']} tokens, {layout['dtype']}")
    rows = [("parameters", estimate["params_bytes"]), ("gradients", estimate["grads_bytes"]),
            ("optimizer state (AdamW)", estimate["optimizer_bytes"]),
            ("activations (saved for backward)", estimate["activations_bytes"]),
            ("  of which alive at the peak", estimate["activations_at_peak_bytes"]),
            ("FSDP's gathered weights (2 layers + groups kept whole)", estimate["gathered_weights_bytes"]),
            ("full-size gradients at their peak (part of the transient)", estimate["full_size_grads_peak_bytes"]),
            (f"transient at the peak ({estimate['peak_phase']})", estimate["transient_bytes"]),
            ("peak", estimate["peak_bytes"])]
    if estimate["cpu_bytes"]:
        rows.insert(3, ("in CPU memory (offloaded state)", estimate["cpu_bytes"]))
    if experts["per_layer"] and not estimate["cpu_bytes"]:
        rows.insert(1, ("  of which the experts'", estimate["expert_params_bytes"]))
    for name, value in rows:
        print(f"  {name:58s} {format_bytes(value):>12s}")
    print("  (transient: gathered weights, unsharded gradients and the loss's gradients at the step's peak)")
    if estimate["pipeline_bubble"]:
        shares = ", ".join(f"{name} {share:.1%}" for name, share in estimate["pipeline_bubble"].items())
        print(f"pipeline bubble, the share of a step each stage idles ({layout['grad_accum']} micro-batches): {shares}")
    print(f"communication per step, sent by this GPU: {format_bytes(estimate['comm_bytes_per_step'])}")
    for group_name, group in estimate["comm_by_group"].items():
        times = ", ".join(f"{group['sent_bytes'] / (gbs * 1e9) * 1e3:,.1f} ms at {gbs:g} GB/s" for gbs in bandwidths)
        kinds = ", ".join(f"{kind} {format_bytes(c['sent_bytes'])}" for kind, c in group["collectives"].items())
        print(f"  {group_name} ({group['group_size']} GPUs): {format_bytes(group['sent_bytes'])} ({kinds}); {times}")


def pipeline_bubble(stages, micro_batches, stages_per_rank=2):
    """The share of a step each stage idles, {chapter 08's --pp-schedule: share}, with p stages on p ranks and m
    micro-batches a step: (p - 1) / (m + p - 1) for GPipe and 1F1B; interleaved 1F1B with v stages per rank cuts
    each stage's work v times finer, (p - 1) / (v m + p - 1) (default v = 2, the chapters'); interleaved zero bubble
    fills two thirds of that with weight gradients, (p - 1) / (3 v m + p - 1) (its paper's ZB-H1, with a forward, an
    input-gradient and a weight-gradient pass taking equal time), and so does ZBV at v = 2; with few micro-batches
    the fill and drain set the span instead, 2vp + vm - 1 units below m = p (interleaved, exact at v = 2) and
    4m + 4p - 2 below m = (3p - 1) / 2 (ZBV). The zero bubbles' shares are those of torch's own schedules run at
    those times (tests/test_estimate_memory.py). Empty without a pipeline."""
    if stages == 1:
        return {}
    bubble = {"gpipe": (stages - 1) / (micro_batches + stages - 1)}
    bubble["1f1b"] = bubble["gpipe"]
    bubble["interleaved-1f1b"] = (stages - 1) / (stages_per_rank * micro_batches + stages - 1)
    work = 3 * stages_per_rank * micro_batches
    bubble["interleaved-zb"] = 1 - work / max(work + stages - 1, stages_per_rank * (2 * stages + micro_batches) - 1)
    bubble["zbv"] = 1 - 6 * micro_batches / max(6 * micro_batches + stages - 1, 4 * micro_batches + 4 * stages - 2)
    return bubble


def describe_layout(layout):
    parts = []
    if layout["dp"] > 1:
        kind = "FSDP" if layout["fsdp"] else "ZeRO-1" if layout["zero1"] else "ZeRO-2" if layout["zero2"] else "DDP"
        parts.append(f"{kind} {layout['dp']}" + (f" ({layout['dp_replicate']} replicas)"
                                                  if layout["dp_replicate"] > 1 else ""))
    for name in ("tp", "pp", "cp"):
        if layout[name] > 1:
            parts.append(f"{name.upper()} {layout[name]}")
    if layout["ep"] is not None:
        parts.append(f"EP {layout['ep']}")
    for name in ("activation_checkpointing", "cpu_offload", "split_root_group"):
        if layout[name]:
            parts.append(name.replace("_", " "))
    return ", ".join(parts) or "one GPU"


def format_bytes(value):
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:,.2f} {unit}"
    return f"{value:,.0f} B"


if __name__ == "__main__":
    main()
