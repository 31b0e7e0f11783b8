"""Which layout for my model and my cluster? Every layout the chapters run, for a model config and a cluster shape,
that fits the GPUs' memory, best first, with its chapter and its command.

    python tools/plan_layout.py -m data/configs/llama-3.1-8b --nnodes 1 --nproc-per-node 8 --seq-length 4096
    python tools/plan_layout.py -m data/configs/llama-3.1-70b --nnodes 8 --nproc-per-node 8 --seq-length 4096
    python tools/plan_layout.py -m data/configs/llama-3.1-405b --nnodes 2048 --nproc-per-node 8 --global-batch-size 2048

It follows the Ultra-Scale Playbook's three steps. 1. Fit a step in memory: each layout's peak per GPU is
tools/estimate_memory.py's (the memory of chapter 01 to 11's code, held to measurements by its tests), and a layout
fits if that peak is at most --memory-fraction of --gpu-memory-gb (the rest: the allocator's rounding, CUDA and
NCCL workspaces). 2. Reach the global batch: one sequence per micro-batch and data-parallel rank, and gradient
accumulation for the rest (the pipeline's micro-batches, with --pp); a layout whose data-parallel ranks do not divide
--global-batch-size is left out. 3. Maximise throughput, with a model of a step's time:

    compute   = FLOPs per GPU / (--peak-tflops x --mfu), with the chapters' FLOPs per token (the MFU they log):
                6 x the active parameters but the input embedding + 12 x layers x heads x head size x sequence,
                x 4/3 with activation checkpointing
    bubble    = compute x b / (1 - b), 1F1B's b = (p - 1) / (m + p - 1), interleaved 1F1B's (p - 1) / (2m + p - 1)
    exposed   = what the chapters wait for: tensor parallel's collectives, the pipeline's sends, the all-to-alls
    overlapped = what runs beside the compute: FSDP's and DDP's collectives, context parallel's ring
    step      = max(compute + bubble + exposed, overlapped)

A collective's time is its bytes (estimate_memory's, per GPU) over the link's bandwidth, plus a latency per ring
hop and call (2(n - 1) hops for an all-reduce, n - 1 for the others): --bandwidth-gbs and --latency-us give the
link inside a node and between nodes. Each chapter's mesh says which groups cross nodes: tensor parallel stays in a
node, and a group whose ranks span more than a node's GPUs crosses. The ring's passes count as overlapped, which
is optimistic at short sequences (each pass overlaps one block's attention only). The pipeline runs 1F1B or
interleaved 1F1B with 2 stages per rank (chapter 08: a smaller bubble, more micro-batches in flight, twice the
sends), with gradients reduced per micro-batch or once a step (--pp-grad-reduce). Every number is an estimate:
dry-run the pick (tools/dry_run.py) before renting the cluster.
"""

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import estimate_memory  # noqa: E402  (the memory model, one definition)
from dry_run import CHAPTERS  # noqa: E402  (each chapter's folder, by its number)

# The groups whose collectives the chapters wait for; FSDP's, DDP's and the ring's run beside the compute.
EXPOSED = ("tp", "pp (stage to stage)", "ep (all-to-all)")


def main():
    args = get_parser().parse_args()
    for name in ["nnodes", "nproc_per_node", "seq_length", "global_batch_size", "gpu_memory_gb", "peak_tflops", "mfu"]:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            estimate_memory.fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name):g}")
    config = estimate_memory.load_config(args.model_name)
    world_size = args.nnodes * args.nproc_per_node
    global_batch = args.global_batch_size or max(1, 2 ** 22 // args.seq_length)
    plans = sorted(candidates(config, args, world_size, global_batch), key=lambda plan: plan.step_seconds)
    fitting = [plan for plan in plans if plan.peak_gb <= args.gpu_memory_gb * args.memory_fraction]
    # NOTE: within 2% of the fastest, the simplest first: fewer kinds of split, less to go wrong, for a time the
    # model cannot tell apart.
    close = [plan for plan in fitting if plan.step_seconds <= 1.02 * fitting[0].step_seconds] if fitting else []
    fitting = sorted(close, key=lambda plan: (plan.splits, plan.step_seconds)) + fitting[len(close):]
    if args.json:
        print(json.dumps([plan.as_dict() for plan in fitting[:args.top]], indent=1))
        return
    print(f"{len(fitting)} of {len(plans)} layouts of {world_size} GPUs fit {args.memory_fraction:.0%} of "
          f"{args.gpu_memory_gb:g} GB at {args.seq_length} tokens, {global_batch} sequences a step; best first:")
    for plan in fitting[:args.top]:
        print(f"\n{plan.describe()}\n  {plan.command}")
    if not fitting:
        raise SystemExit("error: no layout fits; add GPUs, shorten --seq-length, or see chapter 05's --cpu-offload")


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("model and cluster")
    group.add_argument("-m", "--model-name", required=True, help="a folder with config.json, or a hub name")
    group.add_argument("--nnodes", type=int, default=1)
    group.add_argument("--nproc-per-node", type=int, default=8, help="GPUs per node")
    group.add_argument("--gpu-memory-gb", type=float, default=80.0)
    group.add_argument("--memory-fraction", type=float, default=0.9, help="of the GPU's memory a step may use")
    group = parser.add_argument_group("training")
    group.add_argument("--seq-length", type=int, default=8192)
    group.add_argument("--global-batch-size", type=int, help="sequences per step (default: 4M tokens' worth)")
    group = parser.add_argument_group("speed model")
    group.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense (H100, H200: 989)")
    group.add_argument("--mfu", type=float, default=0.4, help="the share of the peak a layer's matmuls reach")
    group.add_argument("--bandwidth-gbs", type=float, nargs=2, default=estimate_memory.DEFAULT_BANDWIDTHS_GBS,
                       metavar=("INSIDE", "BETWEEN"), help="per GPU and direction, inside a node and between nodes")
    group.add_argument("--latency-us", type=float, nargs=2, default=[1.0, 5.0], metavar=("INSIDE", "BETWEEN"),
                       help="per ring hop of a collective")
    group = parser.add_argument_group("output")
    group.add_argument("--top", type=int, default=5, help="layouts to print")
    group.add_argument("--json", action="store_true", help="a list of objects instead of text")
    return parser


@dataclass
class Plan:
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    fsdp: bool
    zero1: bool
    activation_checkpointing: bool
    pp_grad_reduce: str
    pp_schedule: str
    grad_accum: int
    peak_gb: float
    compute_seconds: float
    bubble_seconds: float
    exposed_seconds: float
    overlapped_seconds: float
    chapter: str
    command: str

    @property
    def step_seconds(self):
        return max(self.compute_seconds + self.bubble_seconds + self.exposed_seconds, self.overlapped_seconds)

    @property
    def splits(self):
        return sum(size > 1 for size in (self.tp, self.pp, self.cp, self.ep)) + self.activation_checkpointing + (
            self.pp_schedule != "1f1b")

    def as_dict(self):
        return {**{name: getattr(self, name) for name in self.__dataclass_fields__}, "step_seconds": self.step_seconds}

    def describe(self):
        kind = "FSDP" if self.fsdp else "ZeRO-1" if self.zero1 else "DDP"
        parts = [f"{kind} {self.dp}" if self.dp > 1 else "",
                 *(f"{name} {size}" for name, size in [("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
                                                        ("ep", self.ep)] if size > 1),
                 "interleaved 1F1B" if self.pp_schedule == "interleaved-1f1b" else "",
                 "activation checkpointing" if self.activation_checkpointing else "",
                 "gradients reduced once a step" if self.pp_grad_reduce == "step" else ""]
        return (f"chapter {self.chapter}: {', '.join(filter(None, parts))}; peak {self.peak_gb:.1f} GB; step "
                f"{self.step_seconds:.2f} s (compute {self.compute_seconds:.2f}, bubble {self.bubble_seconds:.2f}, "
                f"waits {self.exposed_seconds:.2f}, beside {self.overlapped_seconds:.2f})")


def candidates(config, args, world_size, global_batch):
    experts = bool(getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0)
                   or getattr(config, "n_routed_experts", 0))
    # NOTE: chapters 08 and 11 refuse a tied embedding across pipeline stages.
    stages = [1] if getattr(config, "tie_word_embeddings", False) else \
        [2 ** power for power in range(8) if 2 ** power <= config.num_hidden_layers]
    for tp in [size for size in (1, 2, 4, 8) if args.nproc_per_node % size == 0]:
        for cp in [size for size in (1, 2, 4, 8) if args.seq_length % (2 * size) == 0]:
            for pp in stages:
                if world_size % (tp * cp * pp) or global_batch % (world_size // (tp * cp * pp)):
                    continue
                dp = world_size // (tp * cp * pp)
                grad_accum = global_batch // dp
                if pp > 1 and grad_accum < pp:
                    continue   # 1F1B: a micro-batch per stage at least
                for ep in expert_degrees(dp, tp, cp, pp, experts, config):
                    chapter = pick_chapter(dp, tp, pp, cp, ep)
                    # (chapter, zero1, activation checkpointing, --pp-grad-reduce, --pp-schedule); chapter 02 too,
                    # with no other split: DDP and ZeRO-1, without activation checkpointing.
                    options = [(chapter, False, checkpointing, reduce, schedule) for checkpointing in (False, True)
                               for reduce in (["microbatch", "step"] if pp > 1 else ["microbatch"])
                               for schedule in pipeline_schedules(pp, grad_accum, config)]
                    options += [("02", zero1, False, "microbatch", "1f1b") for zero1 in (False, True)] \
                        if chapter == "04" and dp > 1 else []
                    for chapter, zero1, checkpointing, reduce, schedule in options:
                        plan = estimate(config, args, world_size, chapter, dp, tp, pp, cp, ep, zero1, checkpointing,
                                        reduce, schedule, grad_accum, global_batch)
                        if plan is not None:
                            yield plan


def pipeline_schedules(pp, micro_batches, config):
    """1F1B, and interleaved 1F1B where its 2 stages per rank have a layer each and its rounds are equal (chapter 08's
    rules). Not the zero-bubble schedules: they run eager (PyTorch splits no compiled backward), and the step model
    does not time the host, which an eager step at these sizes waits for (tests/README.md's host table)."""
    if pp == 1:
        return ["1f1b"]
    interleaved = 2 * pp <= config.num_hidden_layers and micro_batches % max(1, micro_batches // pp) == 0
    return ["1f1b", "interleaved-1f1b"] if interleaved else ["1f1b"]


def expert_degrees(dp, tp, cp, pp, experts, config):
    """Chapter 10 splits the experts over ranks of its data-parallel FSDP; not combined with tp, cp or pp here."""
    if not experts or tp * cp * pp > 1:
        return [1]
    count = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or config.n_routed_experts
    return [size for size in (1, 2, 4, 8, 16, 32, 64) if dp % size == 0 and count % size == 0]


def estimate(config, args, world_size, chapter, dp, tp, pp, cp, ep, zero1, checkpointing, reduce, schedule,
             grad_accum, global_batch):
    # NOTE: every chapter but 02 and 06 shards with FSDP, at dp 1 too (over cp in chapters 09 and 11).
    layout = estimate_memory.Layout(dp=dp, zero1=zero1, fsdp=chapter not in ("02", "06"), tp=tp, pp=pp, cp=cp,
                                    ep=ep if ep > 1 else None, activation_checkpointing=checkpointing,
                                    pp_grad_reduce=reduce, pp_schedule=schedule, batch_size=1,
                                    seq_length=args.seq_length, grad_accum=grad_accum, dtype="bfloat16")
    try:
        result = estimate_memory.estimate_step(config, layout)
    except SystemExit:
        return None   # a layout the chapters reject (a split that does not divide, a plan that does not cover)
    tokens_per_gpu = global_batch * args.seq_length / world_size
    compute = tokens_per_gpu * flops_per_token(config, result, args.seq_length) * (4 / 3 if checkpointing else 1) / (
        args.peak_tflops * 1e12 * args.mfu)
    bubble_share = result["pipeline_bubble"].get(schedule, 0.0)
    spans = group_spans(chapter, world_size, dp, tp, pp, cp, ep)
    exposed = overlapped = 0.0
    for name, group in result["comm_by_group"].items():
        seconds = collective_seconds(group, spans.get(name, world_size) > args.nproc_per_node, args)
        if name in EXPOSED:
            exposed += seconds
        else:
            overlapped += seconds
    return Plan(dp, tp, pp, cp, ep, chapter not in ("02", "06"), zero1, checkpointing, reduce, schedule, grad_accum,
                result["peak_bytes"] / 1e9, compute, compute * bubble_share / (1 - bubble_share), exposed, overlapped,
                chapter, command(chapter, args, global_batch, tp, pp, cp, ep, zero1, checkpointing, reduce, schedule))


def flops_per_token(config, result, seq_length):
    """The chapters' get_flops_per_token: 6 x the parameters a token uses but the input embedding (unless tied),
    and attention's 12 x layers x heads x head size x sequence."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embedding = 0 if getattr(config, "tie_word_embeddings", False) else config.vocab_size * config.hidden_size
    return 6 * (result["num_active_parameters"] - embedding) + 12 * config.num_hidden_layers * heads * head_dim * \
        seq_length


def group_spans(chapter, world_size, dp, tp, pp, cp, ep):
    """How many consecutive ranks each group's members span, on the chapter's mesh (the last dimension varies
    fastest): 07 (dp, tp), 08 (pp, dp), 09 (dp, cp), 10 (edp, ep), 11 (dp, pp, cp, tp); a group spanning more than
    a node's GPUs crosses nodes. FSDP shards over dp x cp in 09 and 11."""
    fsdp = {"08": dp, "09": world_size if dp > 1 else cp, "11": world_size if dp > 1 else tp * cp}.get(chapter,
                                                                                                        world_size)
    return {"tp": tp, "cp (ring attention)": cp * (tp if chapter == "11" else 1),
            "pp (stage to stage)": world_size if chapter == "08" else tp * cp * pp, "ep (all-to-all)": ep,
            "dp (FSDP)": fsdp}


def collective_seconds(group, between_nodes, args):
    bandwidth, latency = (args.bandwidth_gbs[1], args.latency_us[1]) if between_nodes else \
        (args.bandwidth_gbs[0], args.latency_us[0])
    hops = {"send": 1, "all_reduce": 2 * (group["group_size"] - 1)}
    ring = sum(counts["calls"] * hops.get(kind, group["group_size"] - 1)
               for kind, counts in group["collectives"].items())
    return group["sent_bytes"] / (bandwidth * 1e9) + ring * latency * 1e-6


def pick_chapter(dp, tp, pp, cp, ep):
    """The chapter that runs a layout with FSDP over its dp ranks (or none, at dp 1)."""
    if ep > 1:
        return "10"
    split = [size > 1 for size in (tp, pp, cp)]
    if sum(split) > 1:
        return "11"
    if tp > 1:
        return "07" if dp > 1 else "06"
    return "08" if pp > 1 else "09" if cp > 1 else "04"


def command(chapter, args, global_batch, tp, pp, cp, ep, zero1, checkpointing, reduce, schedule):
    flags = ["-m", args.model_name, "--seq-length", str(args.seq_length), "--batch-size", "1", "--global-batch-size",
             str(global_batch)]
    flags += ["--zero1"] if zero1 else []
    flags += ["--tp", str(tp)] if chapter in ("07", "11") else []   # chapter 06: tp is the world size
    flags += ["--pp", str(pp)] if pp > 1 else []
    flags += ["--pp-grad-reduce", "step"] if reduce == "step" else []
    flags += ["--pp-schedule", schedule] if schedule != "1f1b" else []
    flags += ["--cp", str(cp)] if cp > 1 else []
    flags += ["--ep", str(ep)] if ep > 1 else []
    flags += ["--activation-checkpointing"] if checkpointing else []
    flags += ["--compile"] if chapter != "02" else []
    script = f"{CHAPTERS[chapter].name}/train_llm.py"
    if args.nnodes == 1:
        return " ".join(["torchrun --standalone --nproc-per-node", str(args.nproc_per_node), script, *flags])
    return " ".join([f"TRAIN_SCRIPT={script} sbatch --nodes {args.nnodes} --gpus-per-node {args.nproc_per_node}",
                     "03-job-launchers/job.sbatch", *flags])


if __name__ == "__main__":
    main()
