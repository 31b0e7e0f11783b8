"""The GPU numbers card: every chapter measured by its own metrics on this machine's GPUs, in one command.

What it measures, in this order (each run's timeout is cut to what is left of --budget-s, 480 s by default, and a
run that cannot start in time is skipped; a run that fails or overruns is recorded on the card and the card goes on;
card.json and card.md are rewritten after every run, so a card cut short keeps what it measured):

1. The machine: the versions found (against requirements.txt's pins), the GPUs, and the ceiling: a bf16
   8192x8192x8192 matmul's TFLOP/s, the most this GPU delivers.
2. Every chapter folder that exists (NN-*/train_llm.py), at the world size the machine allows (chapter 01 as a plain
   process, the others under torchrun, NCCL), on data/llama-3.2-1b-shape (Llama 3.2 1B's shape, random init), bf16,
   sequence length 2048, batch 4, 30 steps logged every 5: tokens/s, MFU, peak allocated and reserved memory and the
   step-time split (medians over the log windows after the first, from the run's own metrics.jsonl), the fraction of
   the ceiling, the losses against chapter 01's, and a host-sync audit: torch.cuda.set_sync_debug_mode("warn") from
   the end of step 1 on, counting the syncs in the steps that neither are nor follow a logging step (target: 0).
   The audit, and the stop before the final checkpoint (15 GB for this model), are put into the processes by
   dev/gpu_card_site: no card code in the chapters. CHAPTER_ARGS below holds each chapter's extra arguments.
3. Checks, in parallel on the tiny model: a process with LOCAL_RANK=1 that sees one GPU trains (every chapter but
   01; under one GPU per task cuda:LOCAL_RANK is an invalid ordinal), and flash_attention_2's one-line error where
   flash-attn does not import.
4. Chapter 05's options, fine-tuning from a folder holding exactly the seeded initial weights, each compared with
   the plain fine-tune (whose losses must equal the seeded run's): --activation-checkpointing, --compile, and
   --attn-implementation flash_attention_2 when flash-attn imports.
5. The step-overhead benchmark (dev/benchmark_step_overhead.py) for chapters 01 and 04: the bare loop and the
   chapter in fresh processes, alternated 3 times (twice with --cpu); medians and their ratio (target: within
   5%). And chapter 09's ring attention block, forward and backward, against SDPA's flash kernel on one GPU
   (TFLOP/s), since at world size 1 chapters 08 and 09 exercise no pipeline and no ring (their rows say so).
6. The options that step AdamW on the CPU, in short runs from the same folder (the seeded init of --cpu-offload
   would draw other weights, on the CPU): --cpu-offload; the 405B command's features together; chapter 04 with
   --cpu-offload; and, when flash-attn imports, the syncs per layer of flash_attention_2 at batch size 1 (its
   packed-sequence check reads position_ids on the host; target 0).

If the budget cuts the card short, the skipped runs are listed; --parts and --only run them on another visit, e.g.
`python dev/gpu_card.py --only 05 --parts options --out gpu-card-05`.

Output in --out DIR: card.json, card.md, logs/NAME.log for every run, runs/NAME/metrics.jsonl (and sync_audit.json).

On a machine with CUDA GPUs (torch >= 2.11 with CUDA; nothing is downloaded), from the repository root:

    python dev/gpu_card.py --out gpu-card

The chapters also import datasets and wandb (wandb stays disabled). Where they are missing and there is no
internet, bring them as wheels, the ones dev/gpu_card_requirements.txt pins (for Python 3.12 on x86-64). On a
machine with pip and internet, in the repository root:

    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl -r dev/gpu_card_requirements.txt

(about 26 MB), then on the GPU machine, from the repository root with .whl in it:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    timeout 590 python3 dev/gpu_card.py --out /tmp/gpu-card; cp /tmp/gpu-card/card.* "$OUT"/
    tar czf "$OUT"/gpu-card-runs.tgz -C /tmp gpu-card

card.md names every version it found, against the pins. If an import the chapters need fails, the card stops at
once and card.md names the package and the import error (datasets 5.2 needs pyarrow >= 24, for example).

On a machine without a GPU, the same pipeline runs on the bundled tiny model, in fp32 with gloo, the runs in
parallel (their timings mean nothing there) and the benchmark last, alone: MFU and the sync audit are n/a; --compile
uses aot_eager (CARD_COMPILE_BACKEND), as inductor's C++ takes minutes; the options that need CUDA are checked for
their one-line errors (the 405B combination fails at --cpu-offload, as that row shows, and is left out); the
LOCAL_RANK=1 check runs for one chapter and the benchmark for chapter 01 (tests/test_gpu_card.py runs chapter 04's).
The tests run it:

    python dev/gpu_card.py --cpu --out cpu-card

From a GPU card, fill the "Measured on a GPU" sections of the READMEs:

    python dev/gpu_card.py --fill-readmes gpu-card
"""

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CARD_SITE = REPO / "dev" / "gpu_card_site"
BENCHMARK = REPO / "dev" / "benchmark_step_overhead.py"
GPU_MODEL = REPO / "data" / "llama-3.2-1b-shape"
CPU_MODEL = REPO / "data" / "tiny-llama"

# Each chapter's extra arguments on the card, on top of the common ones: chapter_arguments() below. At world size 1
# every degree is 1 and chapters 08 and 09 exercise no pipeline and no ring (their rows say so); on a machine with
# several GPUs the chapter's own parallelism takes them all (08: as many as 1F1B allows, the rest data parallel).
CHAPTER_ARGS = {
    # NOTE: chapter 05 fine-tunes on data/tiny-chat by default; here it trains on chapter 01's text, all of it.
    "05-training-llama-405b": ["-d", str(REPO / "data" / "tiny-shakespeare"), "--eval-fraction", "0"],
    "06-tensor-parallel": [],  # tensor-parallel degree = world size
    "07-2d-parallel": ["--tp", "{nproc}"],  # the chapter's default on one node, said explicitly
    "08-pipeline-parallel": ["--pp", "{pp}"],
    "09-context-parallel": ["--cp", "{nproc}"],
    "11-4d-parallel": ["--tp", "{tp}", "--pp", "{pp_after_tp}"],  # tp 2 (an even nproc), then 08's stages
}
# NOTE: chapter 10 runs the card's dense model at --ep 1 (chapter 04 plus a zero load-balancing loss), at any world
# size: its row says so; its expert parallelism is tested on the CPU (tests/test_10_expert_parallel.py).
PARALLEL_CHAPTERS = ["08-pipeline-parallel", "09-context-parallel", "10-expert-parallel", "11-4d-parallel"]
PIPELINE_CHAPTERS = ["08-pipeline-parallel", "11-4d-parallel"]
RING_CHAPTER = "09-context-parallel"
NOT_EXERCISED = "parallelism not exercised on 1 GPU"
BENCHMARK_CHAPTERS = ["01-single-gpu", "04-fully-sharded-data-parallel"]
OPTIONS_CHAPTER = "05-training-llama-405b"
REFERENCE_CHAPTER = "01-single-gpu"
PARTS = ["chapters", "checks", "benchmark", "options"]
# Packages the chapters import, with the pins of requirements.txt, and what the card reports beside them.
REQUIRED_PACKAGES = ["torch", "transformers", "datasets", "wandb", "tqdm", "huggingface_hub", "safetensors"]
REPORTED_PACKAGES = ["tokenizers", "triton", "flash_attn", "numpy"]

FLASH_ERROR = "error: --attn-implementation flash_attention_2 needs"
OFFLOAD_ERROR = "error: --cpu-offload needs CUDA"
LOSS_TOLERANCE = {"gpu": 5e-2, "cpu": 1e-4}  # bf16 runs differ by kernel order; fp32 CPU runs agree to ~1e-6


def main():
    args = parse_args()
    if args.probe:
        settings = json.loads(args.probe)
        Path(settings["output"]).write_text(json.dumps(probe(settings)))
        return
    if args.time_ring_block:
        settings = json.loads(args.time_ring_block)
        Path(settings["output"]).write_text(json.dumps(time_ring_block(settings)))
        return
    if args.fill_readmes:
        fill_readmes(Path(args.fill_readmes))
        return

    card = Card(Path(args.out), args)
    print(f"gpu_card: {card.mode} card in {card.out_dir}, budget {args.budget_s or 'none'} s", flush=True)
    scratch_dir = make_scratch_dir(args.scratch, card.mode)
    # NOTE: stopped from outside (timeout, Ctrl-C), the card stops its runs, keeps what it measured and cleans up.
    signal.signal(signal.SIGTERM, stop_on_signal)
    try:
        # 1. The machine: versions, GPUs, the matmul ceiling, and the folder of seeded weights for chapter 05.
        environment = run_probe(card, scratch_dir)
        if environment is None or environment.get("missing"):
            card.write()
            raise SystemExit(f"error: {card.data['stopped']}")
        chapters = find_chapters(args.only)
        plan = make_plan(card, chapters, environment, scratch_dir, set(args.parts.split(",")))
        card.data["planned"] = [item.name for item in plan]
        card.write()

        # 2.-6. The runs, in the order of the plan: chapters, checks, chapter 05's quick options, the benchmark,
        # the options that step on the CPU. Each run's result is on the card as soon as it ends.
        for group in group_parallel_runs(plan):
            if len(group) == 1 and isinstance(group[0], BenchmarkRun):
                run_benchmark(card, group[0])
            else:
                run_group(card, group)
            card.write()
    except (KeyboardInterrupt, SystemExit) as stop:
        if not card.data["stopped"]:
            card.data["stopped"] = str(stop) or "interrupted"
            card.write()
        raise
    finally:
        shutil.rmtree(scratch_dir, ignore_errors=True)
    card.data["finished"] = now_iso()
    card.write()
    print((card.out_dir / "card.md").read_text())
    failed = [run["name"] for run in card.data["runs"] if run["status"] in ("failed", "timed out")]
    if failed:
        raise SystemExit(f"error: {len(failed)} run(s) failed or timed out: {', '.join(failed)} "
                         f"(see {card.out_dir / 'card.md'} and the logs)")


def stop_on_signal(signum, frame):
    raise SystemExit(f"error: stopped by signal {signal.Signals(signum).name} before the card was complete")


# ---------------------------------------------------------------------------------------------------------------------
# Arguments


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--out", help="folder for card.json, card.md and every run's log and metrics")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode: the tiny model, fp32, gloo")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole card; runs are cut or skipped past it (default: 480 on a GPU, "
                             "none on the CPU)")
    parser.add_argument("-m", "--model", default=None,
                        help=f"model folder (default: {GPU_MODEL.relative_to(REPO)}, or {CPU_MODEL.relative_to(REPO)} "
                             "with --cpu)")
    parser.add_argument("--steps", type=int, default=None, help="steps per chapter run (default: 30, 12 with --cpu)")
    parser.add_argument("--log-freq", type=int, default=None, help="steps per log window (default: 5, 4 with --cpu)")
    parser.add_argument("--seq-length", type=int, default=None, help="default: 2048, 64 with --cpu")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--nproc", type=int, default=None, help="world size (default: the visible GPUs; 1 on the CPU)")
    parser.add_argument("--only", default=None, help="comma-separated chapter numbers, e.g. 04,05 (default: all)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default: {','.join(PARTS)})")
    parser.add_argument("--chapter-args", action="append", default=[], metavar="CHAPTER=ARGS",
                        help="extra arguments for one chapter, e.g. 07-2d-parallel='--tp 1' (repeatable)")
    parser.add_argument("--scratch", default=None, help="folder for the seeded weights and data caches (removed)")
    parser.add_argument("--fill-readmes", metavar="CARD_DIR",
                        help="write CARD_DIR/card.md into the READMEs' 'Measured on a GPU' sections, then exit")
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    parser.add_argument("--time-ring-block", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe or args.time_ring_block or args.fill_readmes:
        return args
    if not args.out:
        parser.error("--out DIR is required")
    unknown_parts = set(args.parts.split(",")) - set(PARTS)
    if unknown_parts:
        parser.error(f"unknown --parts {sorted(unknown_parts)}; choose from {','.join(PARTS)}")
    gpu = not args.cpu
    args.model = str(Path(args.model or (GPU_MODEL if gpu else CPU_MODEL)).resolve())
    args.steps = args.steps or (30 if gpu else 12)
    args.log_freq = args.log_freq or (5 if gpu else 4)
    args.seq_length = args.seq_length or (2048 if gpu else 64)
    if args.budget_s is None:
        args.budget_s = 480 if gpu else 0
    if args.steps % args.log_freq or args.steps < 2 * args.log_freq:
        parser.error("--steps must be a multiple of --log-freq, and at least two log windows")
    for item in args.chapter_args:
        if "=" not in item:
            parser.error(f"--chapter-args {item!r}: write CHAPTER=ARGS, e.g. 07-2d-parallel='--tp 1'")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# The card: card.json holds everything, card.md is written from it


class Card:
    def __init__(self, out_dir, args):
        self.out_dir = out_dir
        self.mode = "cpu" if args.cpu else "gpu"
        self.args = args
        (out_dir / "logs").mkdir(parents=True, exist_ok=True)
        (out_dir / "runs").mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s if args.budget_s else None
        self.data = {
            "mode": self.mode,
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "started": now_iso(),
            "finished": None,
            "elapsed_s": 0.0,
            "budget_s": args.budget_s or None,
            "settings": {"model": display_path(args.model), "seq_length": args.seq_length,
                         "batch_size": args.batch_size, "steps": args.steps, "log_freq": args.log_freq,
                         "dtype": "bfloat16" if self.mode == "gpu" else "float32",
                         "loss_tolerance": LOSS_TOLERANCE[self.mode]},
            "environment": {},
            "chapter_args": {},
            "planned": [],
            "runs": [],
            "benchmark": {},
            "ring_block": {},
            "stopped": None,
        }

    def seconds_left(self):
        return None if self.deadline is None else self.deadline - time.monotonic()

    def run(self, name):
        return next((run for run in self.data["runs"] if run["name"] == name), None)

    def write(self):
        self.data["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_atomically(self.out_dir / "card.json", json.dumps(self.data, indent=1) + "\n")
        write_atomically(self.out_dir / "card.md", render_markdown(self.data))


def write_atomically(path, text):
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def display_path(path):
    path = Path(path)
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def make_scratch_dir(requested, mode):
    """A folder for the seeded weights (5 GB for the 1B model) and the data cache: in memory if /dev/shm has room."""
    if requested:
        Path(requested).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="gpu-card-", dir=requested))
    shm = Path("/dev/shm")
    needed = 12e9 if mode == "gpu" else 1e9
    parent = shm if shm.is_dir() and shutil.disk_usage(shm).free > needed else None
    return Path(tempfile.mkdtemp(prefix="gpu-card-", dir=parent))


# ---------------------------------------------------------------------------------------------------------------------
# 1. The machine


def run_probe(card, scratch_dir):
    """Versions, GPUs, the matmul ceiling and the flops per token, in a process of its own (the card's own process
    never touches CUDA, so it holds no GPU memory and survives whatever a run does to the GPU)."""
    settings = {"mode": card.mode, "model": card.args.model, "seq_length": card.args.seq_length,
                "pretrained_dir": str(scratch_dir / "seeded-weights"), "output": str(scratch_dir / "probe.json")}
    run = ProcessRun(name="probe", chapter="", options=[], kind="probe", timeout=300,
                     command=[sys.executable, __file__, "--probe", json.dumps(settings)])
    record = execute(card, [run])[0]
    environment = None
    if record["status"] == "ok":
        environment = json.loads(Path(settings["output"]).read_text())
        card.data["environment"] = environment
        if environment["missing"]:
            errors = "; ".join(f"{package}: {environment['import_errors'][package]}"
                               for package in environment["missing"])
            card.data["stopped"] = (f"the chapters import {', '.join(environment['missing'])}, which do not import "
                                    f"here ({errors}); bring them as wheels (python dev/gpu_card.py --help says how)")
        elif card.mode == "gpu" and not environment["cuda"]:
            card.data["stopped"] = "no CUDA GPU here (torch.cuda.is_available() is False); use --cpu"
            environment["missing"] = ["a CUDA GPU"]
    else:
        card.data["stopped"] = f"the probe failed: {record['error']}"
    return environment


def probe(settings):
    """Runs in the probe process: what is installed, the GPUs, the ceiling, the model's FLOPs per token, and a
    Hugging Face folder holding the model's seeded initial weights (chapter 01's init_weights)."""
    import importlib
    import importlib.metadata
    import platform

    environment = {"python": platform.python_version(), "packages": {}, "missing": [], "import_errors": {}}
    pins = dict(re.findall(r"^([\w-]+)==([\w.]+)", (REPO / "requirements.txt").read_text(), re.MULTILINE))
    for package in REQUIRED_PACKAGES + REPORTED_PACKAGES:
        distribution = {"flash_attn": "flash-attn", "huggingface_hub": "huggingface-hub"}.get(package, package)
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = None
        try:
            importlib.import_module(package)
        except Exception as error:  # noqa: BLE001  (flash-attn built for another torch raises all sorts)
            environment["import_errors"][package] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
            if package in REQUIRED_PACKAGES:
                environment["missing"].append(package)
        environment["packages"][package] = {"version": version, "pinned": pins.get(distribution)}
    if "torch" in environment["missing"]:
        environment["cuda"] = False
        return environment

    import torch

    environment["cuda"] = torch.cuda.is_available()
    environment["flash_attn"] = "flash_attn" not in environment["import_errors"] and \
        environment["packages"]["flash_attn"]["version"] is not None
    if environment["cuda"]:
        environment["gpus"] = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())]
        properties = torch.cuda.get_device_properties(0)
        environment["gpu_memory_gb"] = round(properties.total_memory / 1e9, 1)
        environment["cuda_version"] = torch.version.cuda
        nccl_version = torch.cuda.nccl.version()
        environment["nccl_version"] = ".".join(map(str, nccl_version)) if isinstance(nccl_version, tuple) \
            else str(nccl_version)
        environment["driver"] = nvidia_smi_driver()
    environment["cpu_count"] = os.cpu_count()
    if environment["missing"] or (settings["mode"] == "gpu" and not environment["cuda"]):
        return environment
    from transformers import AutoConfig, AutoModelForCausalLM

    environment["ceiling"] = measure_matmul_ceiling(torch, environment["cuda"] and settings["mode"] == "gpu")

    config = AutoConfig.from_pretrained(settings["model"])
    if environment["cuda"] and settings["mode"] == "gpu":
        environment["fp32_gqa_attention"] = fp32_gqa_attention_kernel(torch, config, settings["seq_length"])
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    environment["model"] = {
        "parameters": sum(p.numel() for p in meta_model.parameters()),
        "layers": config.num_hidden_layers,
        "flops_per_token": flops_per_token(meta_model, config, settings["seq_length"]),
    }
    del meta_model
    write_seeded_weights(settings, config, torch, AutoModelForCausalLM, environment["cuda"] and settings["mode"] == "gpu")
    environment["pretrained_dir"] = settings["pretrained_dir"]
    return environment


def fp32_gqa_attention_kernel(torch, config, seq_length, device="cuda", backend="EFFICIENT_ATTENTION"):
    """Whether --dtype float32 attention with the model's grouped-query heads runs a fused SDPA kernel (the
    memory-efficient one, as the chapters call it: is_causal, enable_gqa) or only the math kernel, which holds
    every head's seq_length x seq_length fp32 scores for the backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    query = torch.randn(1, heads, seq_length, head_dim, device=device, requires_grad=True)
    key, value = (torch.randn(1, kv_heads, seq_length, head_dim, device=device, requires_grad=True) for _ in "kv")
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True,
                                                                      enable_gqa=kv_heads != heads)
            output.sum().backward()
        return {"fused": True, "heads": heads, "kv_heads": kv_heads}
    except RuntimeError as error:
        return {"fused": False, "heads": heads, "kv_heads": kv_heads, "error": str(error).splitlines()[0][:200]}


def nvidia_smi_driver():
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
        return result.stdout.strip().splitlines()[0] if result.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return None


def measure_matmul_ceiling(torch, on_gpu):
    """TFLOP/s of a bf16 8192^3 matmul of random values on the GPU (fp32 1024^3 on the CPU): the best of 3 rounds of
    10 products, after a second of warm-up.

    NOTE: an idle GPU runs its clocks low (345 MHz instead of 1980 on an H200, by nvidia-smi): the warm-up is long
    enough for them to rise, and the best round is what the GPU delivers with them up.
    """
    size, dtype = (8192, torch.bfloat16) if on_gpu else (1024, torch.float32)
    device = "cuda" if on_gpu else "cpu"
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def seconds_per_product(count):
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(count):
                a @ b
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / count
        started = time.perf_counter()
        for _ in range(count):
            a @ b
        return (time.perf_counter() - started) / count

    warm_up_until = time.perf_counter() + 1.0
    while time.perf_counter() < warm_up_until:
        seconds_per_product(3)
    seconds = min(seconds_per_product(10) for _ in range(3))
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * size ** 3 / seconds / 1e12}


def flops_per_token(model, config, seq_length):
    """Training FLOPs per token, as the chapters count them (6 N + 12 L H Q T), with the config's head_dim."""
    num_params = sum(p.numel() for p in model.parameters())
    if not config.tie_word_embeddings:
        num_params -= model.get_input_embeddings().weight.numel()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * num_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length


def write_seeded_weights(settings, config, torch, model_class, on_gpu):
    """The model's seeded initial weights as a Hugging Face folder, drawn by chapter 01's init_weights on the device
    the chapters train on, with the model folder's tokenizer files beside them.

    NOTE: chapter 05 fine-tuning from this folder starts from exactly the weights it would draw from the seed on the
    GPU, whatever its options: with --cpu-offload the shards live on the CPU, whose generator draws other numbers.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("chapter_01", REPO / REFERENCE_CHAPTER / "train_llm.py")
    chapter_01 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter_01)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = model_class.from_config(config, dtype=torch.float32)
    chapter_01.init_weights(model, seed=0)
    output_dir = Path(settings["pretrained_dir"])
    model.save_pretrained(output_dir)
    for tokenizer_file in Path(settings["model"]).glob("tokenizer*"):
        shutil.copy(tokenizer_file, output_dir)


# ---------------------------------------------------------------------------------------------------------------------
# The plan: what runs, with which arguments, compared with what


class ProcessRun:
    """One process (or torchrun job) the card starts, and how to read its result."""

    def __init__(self, name, chapter, options, kind, command=None, timeout=180, env=None, stop_after=None,
                 audit=False, reference=None, expect_error=None, expect_log=None, parallel=False, note=None,
                 min_records=0):
        self.name, self.chapter, self.options, self.kind = name, chapter, options, kind
        self.command, self.timeout, self.env = command, timeout, env or {}
        self.stop_after, self.audit, self.reference = stop_after, audit, reference
        self.expect_error, self.expect_log, self.parallel, self.note = expect_error, expect_log, parallel, note
        self.min_records = min_records


class BenchmarkRun:
    """A process writing one JSON result (to the path after --json-out, or output) into card.data[key][chapter]."""

    def __init__(self, name, chapter, command, timeout, key="benchmark", output=None):
        self.name, self.chapter, self.command, self.timeout = name, chapter, command, timeout
        self.key, self.output = key, output or command[command.index("--json-out") + 1]
        self.parallel = False


def find_chapters(only):
    chapters = sorted(path.parent.name for path in REPO.glob("[0-9][0-9]-*/train_llm.py"))
    if only:
        wanted = {number.strip() for number in only.split(",")}
        chapters = [chapter for chapter in chapters if chapter[:2] in wanted]
    return chapters


def make_plan(card, chapters, environment, scratch_dir, parts):
    args, gpu = card.args, card.mode == "gpu"
    nproc = args.nproc or (len(environment.get("gpus", [])) if gpu else 1)
    overrides = {}
    for item in args.chapter_args:
        chapter, extra = item.split("=", 1)
        overrides[chapter] = shlex.split(extra)
    chapter_args = {chapter: chapter_arguments(chapter, nproc, args.batch_size) + overrides.get(chapter, [])
                    for chapter in chapters}
    card.data["chapter_args"] = chapter_args
    card.data["settings"]["nproc"] = nproc
    runs_dir = card.out_dir / "runs"
    steps, log_freq = args.steps, args.log_freq
    common = ["--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
              "--max-steps", str(steps + 1), "--log-freq", str(log_freq), "--ckpt-freq", str(10 ** 9),
              "--warmup-steps", str(min(10, steps // 4)), "--num-workers", "1" if gpu else "0",
              "--wandb-mode", "disabled", "--save-dir", str(runs_dir)]
    if gpu:
        common += ["--lr", "3e-4"]
    pretrained = environment["pretrained_dir"]
    flash = gpu and environment.get("flash_attn", False)
    plan = []

    def training_run(name, chapter, options, model=args.model, stop_after=steps + 1, launcher_nproc=nproc, **kwargs):
        launcher = [sys.executable] if chapter == REFERENCE_CHAPTER else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(launcher_nproc)]
        command = [*launcher, str(REPO / chapter / "train_llm.py"), "-m", model, *common, "-e", name,
                   *chapter_args[chapter], *options]
        env = {"CARD_STOP_AFTER_STEP": str(stop_after), "CARD_SYNC_AUDIT": str(runs_dir / name / "sync_audit.json"),
               **kwargs.pop("env", {})}
        run = ProcessRun(name=name, chapter=chapter, options=options, command=command, stop_after=stop_after,
                         env=env, audit=True, **kwargs)
        run.nproc = 1 if chapter == REFERENCE_CHAPTER else launcher_nproc
        run.main_model = True
        return run

    def error_check(name, chapter, options, expected, note):
        # NOTE: a plain process: the script checks its arguments before anything distributed can go wrong.
        run = training_run(name, chapter, options, kind="option", expect_error=expected, parallel=True,
                           note=note, timeout=300)
        run.command = [sys.executable, *run.command[run.command.index(str(REPO / chapter / "train_llm.py")):]]
        run.audit = False
        return run

    # 2. Every chapter, compared with chapter 01.
    if "chapters" in parts:
        compiled_rows = []
        for chapter in chapters:
            reference = None if chapter == REFERENCE_CHAPTER else REFERENCE_CHAPTER
            model, note = args.model, NOT_EXERCISED if nproc == 1 and chapter in PARALLEL_CHAPTERS else None
            if chapter == "10-expert-parallel" and nproc > 1:
                note = "a dense model at --ep 1: expert parallelism not exercised"
            if chapter in PIPELINE_CHAPTERS and nproc > 1 and args.batch_size > 1:
                model = untied_model(args.model, scratch_dir)
                if model != args.model:
                    reference, note = None, "an untied copy of the model (pipeline stages cannot share one weight)"
            run = training_run(chapter, chapter, [], model=model, kind="chapter", reference=reference, timeout=180,
                               min_records=2, note=note)
            # NOTE: an untied copy has more FLOPs per token than the probe counted: its row gives its own MFU only.
            run.main_model = model == args.model
            plan.append(run)
            if gpu and chapter[:2] >= "04":
                # NOTE: as a real run trains: compiled and checkpointed, against the same chapter's eager row, after
                # every chapter's own row (the card's time budget skips the last runs first).
                compiled = training_run(f"{chapter}+compile+ac", chapter, ["--compile", "--activation-checkpointing"],
                                        model=model, kind="option", reference=chapter, timeout=300, min_records=2,
                                        note=note)
                compiled.main_model = run.main_model
                compiled_rows.append(compiled)
        plan += compiled_rows
        if "10-expert-parallel" in chapters:
            # NOTE: the card's model is dense: chapter 10's own MoE path (grouped_mm, the all-to-alls, the global
            # load-balancing loss) runs on the tiny Qwen3-MoE, against chapter 01 on the same model.
            moe, moe_args = str(REPO / "data" / "tiny-qwen3-moe"), ["--seq-length", "256"]
            for name, chapter, options, reference in [
                    ("01-single-gpu+moe", REFERENCE_CHAPTER, moe_args, None),
                    ("10-expert-parallel+moe", "10-expert-parallel", [*moe_args, "--ep", str(nproc)],
                     "01-single-gpu+moe")]:
                run = training_run(name, chapter, options, model=moe, kind="option", reference=reference,
                                   min_records=2, timeout=180, note="the tiny Qwen3-MoE (8 experts, top-2)")
                run.main_model = False
                plan.append(run)

    # 3. Checks: LOCAL_RANK=1 with one visible GPU (every chapter but 01), on the tiny model.
    if "checks" in parts:
        # NOTE: on the CPU there is no GPU to pick: one chapter's run keeps the command tested.
        for chapter in [chapter for chapter in chapters if chapter != REFERENCE_CHAPTER][:None if gpu else 1]:
            name = f"local-rank-1-{chapter}"
            env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            if gpu:
                env["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            command = [sys.executable, str(REPO / chapter / "train_llm.py"), "-m", str(CPU_MODEL),
                       "--seq-length", "64", "--batch-size", "4", "--max-steps", "2", "--log-freq", "1",
                       "--num-workers", "0", "--wandb-mode", "disabled", "--save-dir", str(runs_dir), "-e", name,
                       *chapter_arguments(chapter, 1, 4)]
            note = ("one visible GPU and LOCAL_RANK=1, where cuda:1 does not exist (tiny model, 2 steps and a "
                    "checkpoint)" if gpu else "n/a on the CPU: no GPU to pick (runs the same command)")
            plan.append(ProcessRun(name=name, chapter=chapter, options=["LOCAL_RANK=1"], kind="check",
                                   command=command, env=env, parallel=True, note=note, timeout=240))
        if OPTIONS_CHAPTER in chapters and not flash:
            plan.append(error_check(f"{OPTIONS_CHAPTER}+flash-attention-error", OPTIONS_CHAPTER,
                                    ["--attn-implementation", "flash_attention_2"], FLASH_ERROR,
                                    "flash-attn does not import here: its one-line error is checked"))

    # 4. Chapter 05's options, fine-tuning from the seeded weights, each compared with the plain fine-tune; the
    # quick ones first, then the benchmark, then those that step AdamW on the CPU (seconds per step on a 1B model).
    if "options" in parts and OPTIONS_CHAPTER in chapters:
        base = f"{OPTIONS_CHAPTER}+pretrained"
        plan.append(training_run(base, OPTIONS_CHAPTER, [], model=pretrained, kind="option",
                                 reference=OPTIONS_CHAPTER, expect_log="loaded the pretrained weights",
                                 note="-m: a folder with the seeded weights, loaded shard by shard", min_records=2,
                                 timeout=180))
        plan.append(training_run(f"{OPTIONS_CHAPTER}+activation-checkpointing", OPTIONS_CHAPTER,
                                 ["--activation-checkpointing"], model=pretrained, kind="option", reference=base,
                                 min_records=2, timeout=180))
        compile_env, compile_note = {}, None
        if not gpu:
            compile_env = {"CARD_COMPILE_BACKEND": "aot_eager"}
            compile_note = "compiled with aot_eager on the CPU: inductor's C++ would take minutes"
        plan.append(training_run(f"{OPTIONS_CHAPTER}+compile", OPTIONS_CHAPTER, ["--compile"], model=pretrained,
                                 kind="option", reference=base, env=compile_env, note=compile_note, min_records=2,
                                 timeout=300))
        if flash:
            plan.append(training_run(f"{OPTIONS_CHAPTER}+flash-attention", OPTIONS_CHAPTER,
                                     ["--attn-implementation", "flash_attention_2"], model=pretrained,
                                     kind="option", reference=base, min_records=2, timeout=180))

    # 5. The step-overhead benchmark.
    if "benchmark" in parts:
        bench_steps = 6 if gpu else 3
        bench_args = ["-m", args.model, "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
                      "--num-workers", "1" if gpu else "0"]
        # NOTE: on the CPU chapter 01 only, twice each, to keep the CPU mode short; tests/test_gpu_card.py runs 04's.
        for chapter in [chapter for chapter in BENCHMARK_CHAPTERS[:None if gpu else 1] if chapter in chapters]:
            json_out = runs_dir / f"benchmark-{chapter}.json"
            command = [sys.executable, str(BENCHMARK), "--chapter", chapter, "--steps", str(bench_steps),
                       "--repeats", "3" if gpu else "2", "--nproc", "1", "--json-out", str(json_out),
                       "--log-dir", str(card.out_dir / "logs" / "benchmark"), "--", *bench_args,
                       *chapter_args[chapter]]
            plan.append(BenchmarkRun(name=f"benchmark-{chapter}", chapter=chapter, command=command,
                                     timeout=360 if gpu else 900))

    # 5b. Chapter 09's ring attention block, forward and backward, against SDPA's flash kernel on the same shapes.
    if "benchmark" in parts and RING_CHAPTER in chapters:
        config = json.loads((Path(args.model) / "config.json").read_text())
        settings = {"mode": card.mode, "output": str(runs_dir / "ring-block.json"),
                    "heads": config["num_attention_heads"], "kv_heads": config["num_key_value_heads"],
                    "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
                    "tokens": [args.seq_length, 4 * args.seq_length]}
        plan.append(BenchmarkRun(name="ring-block-timing", chapter=RING_CHAPTER, key="ring_block",
                                 command=[sys.executable, __file__, "--time-ring-block", json.dumps(settings)],
                                 output=settings["output"], timeout=240))

    # 6. The options that need CUDA: on a GPU, short runs; on the CPU, their one-line errors.
    if "options" in parts and OPTIONS_CHAPTER in chapters:
        base = f"{OPTIONS_CHAPTER}+pretrained"
        together = ["--activation-checkpointing", "--compile", "--cpu-offload"]
        if flash:
            together += ["--attn-implementation", "flash_attention_2"]
        if gpu:
            plan.append(training_run(f"{OPTIONS_CHAPTER}+cpu-offload", OPTIONS_CHAPTER, ["--cpu-offload"],
                                     model=pretrained, kind="option", reference=base, stop_after=2 * log_freq + 1,
                                     note=f"{2 * log_freq} steps: the optimizer steps on the CPU", min_records=1,
                                     timeout=240))
            plan.append(training_run(f"{OPTIONS_CHAPTER}+all", OPTIONS_CHAPTER, together, model=pretrained,
                                     kind="option", reference=base, stop_after=log_freq + 1,
                                     note=f"the 405B command's features together; {log_freq} steps, "
                                          "tokens/s includes the compilation", min_records=1, timeout=300))
            if "04-fully-sharded-data-parallel" in chapters:
                run = training_run("04-fully-sharded-data-parallel+cpu-offload", "04-fully-sharded-data-parallel",
                                   ["--cpu-offload"], kind="check", stop_after=3, timeout=180,
                                   note="chapter 04 trains 2 steps with --cpu-offload (NCCL and gloo)")
                run.audit = False
                plan.append(run)
            if flash:
                plan.append(training_run(f"{OPTIONS_CHAPTER}+flash-attention-batch-1", OPTIONS_CHAPTER,
                                         ["--attn-implementation", "flash_attention_2", "--batch-size", "1"],
                                         kind="check", stop_after=log_freq + 1, timeout=180, min_records=1,
                                         note="syncs per layer at batch size 1 (target 0: no packed-sequence "
                                              "check on the host)"))
        else:
            plan.append(error_check(f"{OPTIONS_CHAPTER}+cpu-offload", OPTIONS_CHAPTER, ["--cpu-offload"],
                                    OFFLOAD_ERROR, "needs CUDA: its one-line error is checked"))
            if "04-fully-sharded-data-parallel" in chapters:
                plan.append(error_check("04-fully-sharded-data-parallel+cpu-offload", "04-fully-sharded-data-parallel",
                                        ["--cpu-offload"], OFFLOAD_ERROR, "needs CUDA: its one-line error is checked"))
    if not gpu:
        # NOTE: the benchmark last, so that every other run is in one parallel group.
        plan = [item for item in plan if isinstance(item, ProcessRun)] + \
            [item for item in plan if isinstance(item, BenchmarkRun)]
    for item in plan:
        if not gpu:
            # NOTE: on the CPU the timings mean nothing (a tiny model, a shared machine): the runs go in parallel,
            # as many as there are cores, and only the benchmark runs alone. They share the cores with each other
            # (and in CI with other jobs): longer timeouts.
            item.parallel = isinstance(item, ProcessRun)
            item.timeout = max(item.timeout, 600)
        if isinstance(item, ProcessRun) and item.chapter:
            missing = missing_flags(item.chapter, item.command)
            if missing:
                item.missing_flags = missing
    return plan


def chapter_arguments(chapter, nproc, batch_size):
    """A chapter's extra arguments at world size nproc with --batch-size batch_size."""
    # NOTE: 1F1B needs a micro-batch per stage (one sequence each): the most stages dividing nproc that the batch fills.
    pp = max(stages for stages in range(1, min(nproc, batch_size) + 1) if nproc % stages == 0)
    tp = 2 if nproc % 2 == 0 else 1
    pp_after_tp = max(stages for stages in range(1, min(nproc // tp, batch_size) + 1) if nproc // tp % stages == 0)
    return [arg.format(nproc=nproc, pp=pp, tp=tp, pp_after_tp=pp_after_tp) for arg in CHAPTER_ARGS.get(chapter, [])]


def untied_model(model, scratch_dir):
    """The model folder, or where its config ties the output head to the embeddings, an untied copy (config and
    tokenizer files) in scratch_dir: pipeline stages cannot share one weight (chapter 08's check)."""
    config = json.loads((Path(model) / "config.json").read_text())
    if not config.get("tie_word_embeddings"):
        return model
    copy = Path(scratch_dir) / f"{Path(model).name}-untied"
    copy.mkdir(parents=True, exist_ok=True)
    (copy / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    for tokenizer_file in Path(model).glob("tokenizer*"):
        shutil.copy(tokenizer_file, copy)
    return str(copy)


def missing_flags(chapter, command):
    """The flags of a command that the chapter's script does not define (its source has no "--flag")."""
    source = (REPO / chapter / "train_llm.py").read_text()
    script_index = next(i for i, part in enumerate(command) if part.endswith("train_llm.py"))
    flags = [part for part in command[script_index + 1:] if re.fullmatch(r"--?[a-zA-Z][\w-]*", part)]
    return sorted({flag for flag in flags if f'"{flag}"' not in source})


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_parallel_runs(plan):
    """Consecutive runs marked parallel (checks whose time is not measured) go together; the rest one by one."""
    groups = []
    for item in plan:
        if item.parallel and groups and groups[-1][0].parallel:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


# ---------------------------------------------------------------------------------------------------------------------
# Running: each run in a process session of its own, with a deadline; whatever it leaves behind is stopped

# NOTE: a run is not started with less of the budget left: too short to measure anything.
MIN_SECONDS_TO_START = 15


def run_group(card, group):
    """Run a group (one run, or checks in parallel); each run is read and the card rewritten as soon as it ends."""
    runs = {run.name: run for run in group}

    def record_finished(record):
        run = runs[record["name"]]
        if record["status"] in ("ok", "failed", "timed out"):
            summarize_run(card, run, record)
        card.data["runs"] = [existing for existing in card.data["runs"] if existing["name"] != record["name"]]
        card.data["runs"].append(record)
        card.write()

    execute(card, group, record_finished)
    # NOTE: in a parallel group a run may end before the run its losses are compared with.
    for run in group:
        record = card.run(run.name)
        if run.reference and record.get("losses"):
            record["loss_match"] = compare_losses(card, record, run.reference)


def execute(card, runs, on_finished=None):
    """Start the runs (several at once where they are parallel), wait for them under their timeouts (cut to the
    budget left), and return their records in the order of the runs; on_finished(record) as each one ends."""
    max_parallel = 8 if card.mode == "gpu" else max(2, os.cpu_count() or 1)
    records = {}
    pending = list(runs)
    active = []

    def finished(record):
        if on_finished:
            on_finished(record)
        print(f"gpu_card: {record['name']}: {record['status']}"
              f"{' (' + record['error'] + ')' if record.get('error') else ''} in {record['seconds']:.0f}s",
              flush=True)

    try:
        wait_for_runs(card, pending, active, records, max_parallel, finished)
    finally:
        for process in active:
            stop_session(process.popen)
            stop_marked_processes(process.marker)
    return [records[run.name] for run in runs]


def wait_for_runs(card, pending, active, records, max_parallel, finished):
    """Keep up to max_parallel runs going until every pending run has ended, been skipped or been refused."""
    while pending or active:
        while pending and len(active) < max_parallel:
            run = pending.pop(0)
            record = {"name": run.name, "chapter": run.chapter, "options": run.options, "kind": run.kind,
                      "log": f"logs/{run.name}.log", "note": run.note, "status": None, "seconds": 0.0,
                      "error": None}
            records[run.name] = record
            left = card.seconds_left()
            if getattr(run, "missing_flags", None):
                record.update(status="failed", error=f"the script has no {', '.join(run.missing_flags)} flag: "
                                                     "fix the card's CHAPTER_ARGS")
                finished(record)
            elif left is not None and left < MIN_SECONDS_TO_START:
                record.update(status="skipped", error="the time budget (--budget-s) is spent")
                finished(record)
            else:
                timeout = run.timeout if left is None else min(run.timeout, left)
                active.append(start_process(card, run, record, timeout))
        time.sleep(0.2)
        for process in list(active):
            if process.poll():
                active.remove(process)
                finished(process.record)


class StartedProcess:
    def __init__(self, popen, log, record, started, timeout, marker):
        self.popen, self.log, self.record, self.started = popen, log, record, started
        self.timeout, self.marker = timeout, marker

    def poll(self):
        """True once the process has ended (or was stopped at its deadline); the record is then complete."""
        elapsed = time.monotonic() - self.started
        if self.popen.poll() is None and elapsed < self.timeout:
            return False
        timed_out = self.popen.poll() is None
        if timed_out:
            stop_session(self.popen)
        self.popen.wait()
        stop_marked_processes(self.marker)
        self.log.close()
        log_text = Path(self.log.name).read_text(errors="replace")
        self.record["seconds"] = round(time.monotonic() - self.started, 1)
        self.record["returncode"] = self.popen.returncode
        if timed_out:
            self.record.update(status="timed out", error=f"stopped after {self.timeout:.0f}s")
        elif self.popen.returncode == 0:
            self.record["status"] = "ok"
        else:
            self.record.update(status="failed", error=error_line(log_text))
        return True


def start_process(card, run, record, timeout):
    marker = uuid.uuid4().hex
    env = {**os.environ, **base_env(card.mode), **run.env, "GPU_CARD_RUN_MARKER": marker}
    log_path = card.out_dir / record["log"]
    log = open(log_path, "w")
    log.write(f"$ {' '.join(f'{key}={value}' for key, value in run.env.items())} {shlex.join(run.command)}\n")
    log.flush()
    record["command"] = shlex.join(run.command)
    popen = subprocess.Popen(run.command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    return StartedProcess(popen, log, record, time.monotonic(), timeout, marker)


def base_env(mode):
    """Offline, no wandb, the card's sitecustomize first on the path."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(CARD_SITE), os.environ.get("PYTHONPATH")]))}
    if mode == "cpu":
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")  # NOTE: the runs share the cores
    if mode == "gpu":
        # NOTE: as chapter 05's launch.sh sets it: fewer fragmented blocks when FSDP frees and gathers layers.
        env["PYTORCH_ALLOC_CONF"] = os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                                      "expandable_segments:True"))
    return env


def stop_session(popen):
    """SIGTERM first (torchrun then stops its workers), SIGKILL the session 15 seconds later."""
    try:
        os.killpg(popen.pid, signal.SIGTERM)
        popen.wait(timeout=15)
    except (ProcessLookupError, PermissionError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_marked_processes(marker):
    """SIGKILL every process that still carries this run's marker: torchrun's workers live in sessions of their
    own, and data loader workers outlive a worker that ended abruptly."""
    needle = f"GPU_CARD_RUN_MARKER={marker}".encode()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if needle in (proc / "environ").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


def error_line(log_text):
    """The line that says why a run failed: the script's `error: ...`, else the last exception, else the last line."""
    lines = [re.sub(r"^\[(?:rank|default)\d+\]:\s*", "", line).strip() for line in log_text.splitlines()]
    lines = [line for line in lines if line]
    for pattern in [r"^error: ", r"^[\w.]*(Error|Exception|Interrupt)\b.*"]:
        matches = [line for line in lines if re.match(pattern, line)]
        if matches:
            return matches[-1][:400]
    return lines[-1][:400] if lines else "no output"


# ---------------------------------------------------------------------------------------------------------------------
# Reading a run: its metrics, its sync audit, its losses against its reference


def summarize_run(card, run, record):
    log_text = (card.out_dir / record["log"]).read_text(errors="replace")
    if run.expect_error:
        found = error_line(log_text)
        expected = record["status"] == "failed" and found.startswith(run.expect_error)
        record.update(status="expected error" if expected else "failed",
                      error=found if expected else f"expected {run.expect_error!r}, got: {found}")
        return
    if run.expect_log and record["status"] == "ok" and run.expect_log not in log_text:
        record.update(status="failed", error=f"the log does not say {run.expect_log!r}")
    metrics_file = card.out_dir / "runs" / run.name / "metrics.jsonl"
    if run.kind == "check" and not run.audit:
        return
    records = read_metrics(metrics_file)
    record["losses"] = {str(r["step"]): r["loss"] for r in records}
    if record["status"] == "ok" and len(records) < run.min_records:
        record.update(status="failed", error=f"logged {len(records)} steps, expected at least {run.min_records}")
    steady = records[1:] if len(records) > 1 else records
    record["measured_steps"] = [r["step"] for r in steady]
    record["warm_up_included"] = len(records) == 1
    if steady:
        record["tokens_per_second"] = statistics.median(r["tokens_per_second"] for r in steady)
        mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
        record["mfu"] = statistics.median(mfus) if mfus else None
        for key in ["memory_allocated_gb", "memory_reserved_gb", "memory_rss_gb"]:
            if key in steady[0]:
                record[key] = max(r[key] for r in records)
        environment = card.data["environment"]
        if getattr(run, "main_model", False):
            achieved = record["tokens_per_second"] * environment["model"]["flops_per_token"] / run.nproc
            record["achieved_tflops"] = achieved / 1e12
            record["fraction_of_ceiling"] = achieved / 1e12 / environment["ceiling"]["tflops"]
    if run.audit:
        record["syncs"] = read_sync_audit(card.out_dir / "runs" / run.name / "sync_audit.json", card.args.log_freq)
        if card.mode == "cpu" or not record["syncs"].get("cuda"):
            # NOTE: on the CPU nothing synchronizes with a device: the audit ran, and counts nothing.
            record["syncs"].update(per_step=None, why="n/a on the CPU")
        if run.name.endswith("flash-attention-batch-1") and record["syncs"].get("per_step") is not None:
            record["syncs"]["per_layer"] = record["syncs"]["per_step"] / card.data["environment"]["model"]["layers"]
    if run.reference:
        record["loss_match"] = compare_losses(card, record, run.reference)


def read_metrics(metrics_file):
    """The last record logged for each step."""
    if not metrics_file.exists():
        return []
    by_step = {}
    for line in metrics_file.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a timeout
        by_step[entry["step"]] = entry
    return [by_step[step] for step in sorted(by_step)]


def read_sync_audit(audit_file, log_freq):
    """Syncs per step over the audited steps: from step 3 on (steps 1 and 2 set things up once), leaving out each
    step that follows a logging step (its count includes that logging, which synchronizes on purpose)."""
    if not audit_file.exists():
        return {"per_step": None, "why": "no audit written (the run ended before its first step)"}
    audit = json.loads(audit_file.read_text())
    counts = {int(step): count for step, count in audit["syncs_before_step"].items()}
    last_step = audit["steps"]
    audited = [step for step in range(3, last_step + 1) if (step - 1) % log_freq != 0]
    total = sum(counts.get(step, 0) for step in audited)
    return {
        "cuda": audit["cuda"],
        "per_step": total / len(audited) if audited else None,
        "audited_steps": len(audited),
        "syncs_in_audited_steps": total,
        "syncs_in_step_2": counts.get(2, 0),
        "syncs_after_logging_steps": sum(counts.get(step, 0) for step in range(3, last_step + 1) if step not in audited),
        "where": dict(sorted(audit["where"].items(), key=lambda item: -item[1])[:8]),
    }


def compare_losses(card, record, reference_name):
    reference = card.run(reference_name)
    if reference is None or not reference.get("losses"):
        return {"max_difference": None, "why": f"no losses from {reference_name}"}
    common = sorted(set(record.get("losses", {})) & set(reference["losses"]), key=int)
    if not common:
        return {"max_difference": None, "why": "no common logged steps"}
    difference = max(abs(record["losses"][step] - reference["losses"][step]) for step in common)
    tolerance = LOSS_TOLERANCE[card.mode]
    return {"reference": reference_name, "steps": len(common), "max_difference": difference,
            "tolerance": tolerance, "match": difference <= tolerance}


# ---------------------------------------------------------------------------------------------------------------------
# 4. The step-overhead benchmark


def run_benchmark(card, benchmark):
    run = ProcessRun(name=benchmark.name, chapter=benchmark.chapter, options=[], kind="benchmark",
                     command=benchmark.command, timeout=benchmark.timeout)
    record, = execute(card, [run])
    json_out = Path(benchmark.output)
    if record["status"] == "ok":
        if json_out.exists():
            card.data[benchmark.key][benchmark.chapter] = json.loads(json_out.read_text())
        else:
            record.update(status="failed", error="the benchmark wrote no result")
    card.data["runs"] = [existing for existing in card.data["runs"] if existing["name"] != record["name"]]
    card.data["runs"].append(record)


def time_ring_block(settings):
    """Runs in its own process: chapter 09's ring attention block (attention_block and attention_block_backward, called
    as RingAttention calls them on its own causal block) against SDPA's flash kernel on the same shapes, in TFLOP/s.

    NOTE: both are credited the causal attention's useful FLOPs, 2 matmuls of b h s^2 d / 2 multiply-adds forward and
    2.5 times that backward (FlashAttention's convention), so their TFLOP/s compare as their times do.
    """
    import importlib.util

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = importlib.util.spec_from_file_location("chapter_09", REPO / RING_CHAPTER / "train_llm.py")
    chapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chapter)
    on_gpu = settings["mode"] == "gpu" and torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    heads, kv_heads, head_dim = settings["heads"], settings["kv_heads"], settings["head_dim"]
    results = {"device": torch.cuda.get_device_name(0) if on_gpu else "cpu", "dtype": str(dtype)[6:],
               "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "rows": []}

    def seconds(function, repeats):
        function()
        if on_gpu:
            torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            function()
            if on_gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    for tokens in settings["tokens"]:
        make = lambda groups: torch.randn(1, groups, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
        query, key, value = make(heads), make(kv_heads), make(kv_heads)
        grad = torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype)
        scale = head_dim ** -0.5
        # NOTE: as inside RingAttention's forward and backward: no autograd, grad_output in the compute dtype, delta
        # in fp32.
        with torch.no_grad():
            block_output, lse = chapter.attention_block(query, key, value, scale, True)
        delta = (grad.float() * block_output.to(dtype).float()).sum(-1)
        ring = {"forward": torch.no_grad()(lambda: chapter.attention_block(query, key, value, scale, True)),
                "backward": torch.no_grad()(lambda: chapter.attention_block_backward(
                    grad, query, key, value, lse, delta, scale, True))}
        # NOTE: the flash kernel wants as many key/value heads as query heads.
        full_key, full_value = (states.detach().repeat_interleave(heads // kv_heads, dim=1).requires_grad_()
                                for states in (key, value))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            output = torch.nn.functional.scaled_dot_product_attention(query, full_key, full_value, is_causal=True,
                                                                      scale=scale)
            flash = {"forward": lambda: torch.nn.functional.scaled_dot_product_attention(
                         query, full_key, full_value, is_causal=True, scale=scale),
                     "backward": lambda: torch.autograd.grad(output, (query, full_key, full_value), grad,
                                                             retain_graph=True)}
            forward_flops = 4 * heads * tokens * tokens * head_dim / 2
            row = {"tokens": tokens, "max_output_difference": (block_output - output).abs().max().item()}
            for name, attention in (("ring_block", ring), ("sdpa_flash", flash)):
                forward, backward = (seconds(attention[part], settings.get("repeats", 5)) for part in attention)
                row[name] = {"forward_ms": forward * 1e3, "backward_ms": backward * 1e3,
                             "forward_tflops": forward_flops / forward / 1e12,
                             "backward_tflops": 2.5 * forward_flops / backward / 1e12}
            results["rows"].append(row)
        del query, key, value, full_key, full_value, grad, output, block_output, lse, delta
    return results


# ---------------------------------------------------------------------------------------------------------------------
# card.md


def render_markdown(data):
    environment, settings = data["environment"], data["settings"]
    title = "# GPU card" if data["mode"] == "gpu" else "# CPU card (the CPU mode: not a GPU measurement)"
    lines = [title, ""]
    lines += header_lines(data)
    lines += ["", "| chapter | options | tokens/s | MFU | of ceiling | peak memory | overhead vs bare loop | syncs/step "
              "| loss vs reference |", "|" + " --- |" * 9]
    for run in data["runs"]:
        if run["kind"] in ("chapter", "option"):
            lines.append(table_row(run, data))
    benchmark = data["benchmark"]
    if benchmark:
        lines += ["", "Step-overhead benchmark (`dev/benchmark_step_overhead.py`: the bare loop and the chapter in "
                  "fresh processes, alternated; medians):", "",
                  "| chapter | bare loop ms | chapter ms | ratio | overhead | samples (bare; chapter) |",
                  "|" + " --- |" * 6]
        for chapter, result in benchmark.items():
            lines.append(f"| {chapter} | {result['bare_median_ms']:.1f} | {result['chapter_median_ms']:.1f} | "
                         f"{result['ratio']:.3f} | {result['overhead_percent']:+.1f}% | "
                         f"{', '.join(f'{ms:.1f}' for ms in result['bare_step_ms'])}; "
                         f"{', '.join(f'{ms:.1f}' for ms in result['chapter_step_ms'])} |")
    for chapter, result in data.get("ring_block", {}).items():
        lines += ["", f"{chapter}'s ring attention block on one {result['device']} ({result['dtype']}, "
                  f"{result['heads']} heads, {result['kv_heads']} key/value heads of {result['head_dim']}; its "
                  "attention_block and attention_block_backward, as RingAttention calls them) against SDPA's flash "
                  "kernel on the same shapes, causal TFLOP/s (medians):", "",
                  "| tokens | ring block fwd / bwd ms | TFLOP/s | flash fwd / bwd ms | TFLOP/s | outputs differ by |",
                  "|" + " --- |" * 6]
        for row in result["rows"]:
            ring, flash = row["ring_block"], row["sdpa_flash"]
            lines.append(f"| {row['tokens']} | " + " | ".join(
                f"{part['forward_ms']:.2f} / {part['backward_ms']:.2f} | "
                f"{part['forward_tflops']:.3g} / {part['backward_tflops']:.3g}" for part in (ring, flash))
                + f" | {row['max_output_difference']:.1e} |")
    checks = [run for run in data["runs"] if run["kind"] == "check"]
    flash_unmeasured = data["mode"] == "gpu" and environment.get("model") and not environment.get("flash_attn") \
        and OPTIONS_CHAPTER in data["chapter_args"]
    if checks or flash_unmeasured:
        lines += ["", "Checks:", ""]
        for run in checks:
            lines.append(f"- {run['chapter']} {' '.join(run['options'])}: {check_result(run)}"
                         f"{' (' + run['note'] + ')' if run.get('note') else ''}")
        if flash_unmeasured:
            lines.append(f"- {OPTIONS_CHAPTER} --attn-implementation flash_attention_2 --batch-size 1: not measured: "
                         "flash-attn does not import here; a flash-attn wheel built for this torch and CUDA "
                         "would let the card count its syncs per layer at batch size 1")
    problems = [run for run in data["runs"] if run["status"] not in ("ok", "expected error")]
    sync_notes = [run for run in data["runs"] if (run.get("syncs") or {}).get("syncs_in_audited_steps")]
    expected_errors = [run for run in data["runs"] if run["status"] == "expected error"]
    if problems or sync_notes or expected_errors or data.get("stopped"):
        lines += ["", "Notes:", ""]
        if data.get("stopped"):
            lines.append(f"- stopped: {data['stopped']}")
        for run in problems:
            lines.append(f"- {run['name']}: {run['status']}: {run.get('error')} (`{run['log']}`)")
        for run in data["runs"]:
            if run["status"] == "expected error":
                lines.append(f"- {run['name']}: the expected one-line error: `{run['error']}`")
        for run in sync_notes:
            where = "; ".join(f"{place} x{count}" for place, count in run["syncs"]["where"].items())
            lines.append(f"- {run['name']}: syncs at {where}")
    if data["chapter_args"]:
        lines += ["", "Per-chapter arguments (`CHAPTER_ARGS` in dev/gpu_card.py, on top of the common ones):", ""]
        lines.append("; ".join(f"{chapter}: {shlex.join(display_path(arg) for arg in extra) or 'none'}"
                               for chapter, extra in data["chapter_args"].items()))
    lines += ["", f"Every run's log is in `logs/NAME.log`, its metrics in `runs/NAME/metrics.jsonl`; everything "
                  f"above is in `card.json`. Command: `{data['command']}`.", ""]
    return "\n".join(lines)


def header_lines(data):
    environment, settings = data["environment"], data["settings"]
    if data.get("stopped"):
        status = f"**Status**: stopped: {data['stopped']}"
    elif not data["finished"]:
        done = len(data["runs"])
        status = f"**Status**: in progress, {done} of {len(data['planned']) + 1} runs, {data['elapsed_s']:.0f} s"
    else:
        skipped = sum(run["status"] == "skipped" for run in data["runs"])
        status = f"**Status**: complete in {data['elapsed_s']:.0f} s" + \
            (f" ({skipped} runs skipped: the time budget was spent)" if skipped else "")
    lines = [f"**Measured**: {data['started']}. {status}."]
    if environment.get("packages"):
        packages = ", ".join(
            f"{name} {info['version'] or 'missing'}"
            + (f" (pinned {info['pinned']})" if info["pinned"] and info["pinned"] != info["version"] else "")
            for name, info in environment["packages"].items() if info["version"] or name in REQUIRED_PACKAGES)
        machine = ", ".join(filter(None, [
            f"{len(environment['gpus'])} x {environment['gpus'][0]} ({environment['gpu_memory_gb']} GB)"
            if environment.get("gpus") else "CPU only",
            f"driver {environment['driver']}" if environment.get("driver") else None,
            f"CUDA {environment['cuda_version']}, NCCL {environment['nccl_version']}"
            if environment.get("cuda_version") else None,
            f"{environment.get('cpu_count')} CPU cores", f"Python {environment['python']}"]))
        lines.append(f"**Machine**: {machine}. **Software**: {packages}; "
                     f"flash-attn {'imports' if environment.get('flash_attn') else 'does not import'}.")
    if environment.get("model"):
        model = environment["model"]
        lines.append(f"**Model**: `{settings['model']}` ({model['parameters'] / 1e6:,.1f}M parameters, random init, "
                     f"{model['flops_per_token'] / 1e9:.3g} GFLOP per token), sequence length "
                     f"{settings['seq_length']}, batch {settings['batch_size']} per process, {settings['dtype']}, "
                     f"world size {settings.get('nproc', '?')}, {settings['steps']} steps logged every "
                     f"{settings['log_freq']}; figures are medians over the log windows after the first.")
    if environment.get("ceiling"):
        ceiling = environment["ceiling"]
        size = ceiling["size"]
        lines.append(f"**Ceiling**: a {ceiling['dtype']} {size}x{size}x{size} matmul runs at "
                     f"{ceiling['tflops']:.3g} TFLOP/s here; \"of ceiling\" is each run's model FLOP/s per process "
                     f"over that.")
    if environment.get("fp32_gqa_attention"):
        kernel = environment["fp32_gqa_attention"]
        verdict = "runs SDPA's memory-efficient kernel" if kernel["fused"] else \
            f"has only SDPA's math kernel ({kernel['error']})"
        lines.append(f"**fp32 attention**: `--dtype float32` with {kernel['heads']} query and {kernel['kv_heads']} "
                     f"key/value heads {verdict}.")
    return lines


def table_row(run, data):
    chapter = run["chapter"]
    options = " ".join(run["options"]) or ("(seeded weights)" if "+pretrained" in run["name"] else "")
    if run["name"].endswith("+pretrained"):
        options = "-m seeded-weights folder"
    if run["name"].endswith("+moe"):
        options = f"-m data/tiny-qwen3-moe {options}"
    if run["kind"] == "chapter" and run.get("note"):
        options = f"({run['note']})"
    if run["status"] not in ("ok",) and not run.get("tokens_per_second"):
        status = "expected error ✓" if run["status"] == "expected error" else f"{run['status']} ✗"
        return f"| {chapter} | {options} | {status} | | | | | | | |"
    tokens = f"{run['tokens_per_second']:,.0f}" + (" (incl. warm-up)" if run.get("warm_up_included") else "")
    if run["status"] != "ok":
        tokens += f" ({run['status']} ✗)"
    mfu = "n/a" if run.get("mfu") is None else f"{run['mfu']:.1%}"
    ceiling = "n/a" if run.get("fraction_of_ceiling") is None else f"{run['fraction_of_ceiling']:.1%}"
    if "memory_allocated_gb" in run:
        memory = f"{run['memory_allocated_gb']:.1f} / {run['memory_reserved_gb']:.1f} GB"
    elif "memory_rss_gb" in run:
        memory = f"{run['memory_rss_gb']:.2f} GB RSS"
    else:
        memory = ""
    benchmark = data["benchmark"].get(chapter) if run["kind"] == "chapter" else None
    overhead = f"{benchmark['overhead_percent']:+.1f}%" if benchmark else ""
    syncs = run.get("syncs") or {}
    sync_text = "n/a" if syncs.get("per_step") is None else f"{syncs['per_step']:.2g}"
    match = run.get("loss_match")
    if run["kind"] == "chapter" and chapter == REFERENCE_CHAPTER:
        loss = "reference"
    elif not match:
        loss = ""
    elif match["max_difference"] is None:
        loss = f"n/a ({match['why']})"
    else:
        loss = f"{'✓' if match['match'] else '✗'} {match['max_difference']:.1e} vs {match['reference']}"
    return f"| {chapter} | {options} | {tokens} | {mfu} | {ceiling} | {memory} | {overhead} | {sync_text} | {loss} |"


def check_result(run):
    if run["status"] == "expected error":
        return f"✓ the one-line error: `{run['error']}`"
    if run["status"] != "ok":
        return f"✗ {run['status']}: {run.get('error')}"
    syncs = run.get("syncs") or {}
    if syncs.get("per_layer") is not None:
        verdict = "✓" if syncs["per_layer"] == 0 else "✗"
        return f"{verdict} {syncs['per_layer']:.2g} syncs per layer per step ({syncs['per_step']:.3g} per step)"
    return "✓ trains"


# ---------------------------------------------------------------------------------------------------------------------
# The READMEs' "Measured on a GPU" sections

SECTION_TITLE = "## Measured on a GPU"
BEGIN_MARKER = "<!-- gpu-card: begin -->"
END_MARKER = "<!-- gpu-card: end -->"


def fill_readmes(card_dir):
    """Keep the card in docs/gpu-card/ and write its lines into every README's section: a pointer to it and its
    headline in the top-level README, each chapter's rows, benchmark and checks in its own."""
    card_md = card_dir / "card.md" if card_dir.is_dir() else card_dir
    if not card_md.exists():
        raise SystemExit(f"error: {card_md} does not exist; measure a card first: python dev/gpu_card.py --out DIR")
    text = card_md.read_text()
    if not text.startswith("# GPU card"):
        raise SystemExit(f"error: {card_md} is not a GPU card (it was made with --cpu); measure one on a GPU")
    kept = REPO / "docs" / "gpu-card"
    kept.mkdir(parents=True, exist_ok=True)
    for name in ["card.md", "card.json"]:
        if (card_md.parent / name).exists() and (card_md.parent / name).resolve() != (kept / name).resolve():
            shutil.copy(card_md.parent / name, kept / name)
    card_md = kept / "card.md"
    body = text.split("\n", 1)[1].strip()
    # NOTE: the top-level README stays short: the date, the machine, chapter 01's speed and where the rest is.
    headline = re.search(r"\*\*Measured\*\*: (\S+).*\*\*Machine\*\*: ([^,(]+).*?\*\*Software\*\*: (torch \S+)", body, re.S)
    first_row = next((line.split("|") for line in body.splitlines() if line.startswith("| 01-single-gpu |  |")), None)
    speed = f": chapter 01 trains at {first_row[3].strip()} tokens/s, {first_row[4].strip()} MFU" if first_row else ""
    write_section(REPO / "README.md", f"Measured on {headline[1]} on {headline[2].strip()} with {headline[3]}{speed}. "
                  f"The card: [{display_path(card_md)}]({display_path(card_md)}); each chapter's README has its rows.")
    # NOTE: the card's header once, in the card; a chapter's section names the machine and the model its rows ran.
    model = re.search(r"\*\*Model\*\*: (`[^`]+`) \([^)]*\), (sequence length \d+, batch \d+ per process, \w+)", body)
    shape = f": {model[1]}, {model[2]}" if model else ""
    source = (f"[The GPU card](../{display_path(card_md)}) ({headline[1]}, {headline[2].strip()}, {headline[3]}; its "
              f"header gives the method){shape}. Written by `dev/gpu_card.py`: edit the card, not this section.")
    for readme in sorted(REPO.glob("[0-9][0-9]-*/README.md")):
        chapter = readme.parent.name
        rows = [line for line in body.splitlines() if line.startswith(f"| {chapter} |")]
        checks = [line for line in body.splitlines() if re.match(rf"- {re.escape(chapter)}[ +:]", line)]
        tables = [line for line in body.splitlines() if line.startswith("| chapter |")]
        parts = [source]
        # NOTE: a row belongs to the table with as many columns: the main table's or the benchmark's.
        main_rows = [row for row in rows if row.count("|") == tables[0].count("|")]
        bench_rows = [row for row in rows if len(tables) > 1 and row.count("|") == tables[1].count("|")]
        if main_rows:
            parts.append("\n".join([tables[0], "|" + " --- |" * (tables[0].count("|") - 1), *main_rows]))
        if bench_rows:
            parts.append("\n".join(["Step-overhead benchmark (medians of fresh processes, alternated):", "",
                                    tables[1], "|" + " --- |" * (tables[1].count("|") - 1), *bench_rows]))
        if checks:
            parts.append("\n".join(checks))
        if not main_rows and not checks:
            parts.append(f"The card has no run of {chapter}.")
        write_section(readme, "\n\n".join(parts))
        print(f"filled {display_path(readme)}")
    print("filled README.md")


def not_measured_section():
    return ("Not yet measured on a GPU. On a machine with CUDA GPUs, from the repository root, the first command "
            "measures every chapter\nin at most 8 minutes (`python dev/gpu_card.py --help` says what and how), "
            "the second writes the numbers here:\n\n```bash\npython dev/gpu_card.py --out gpu-card\n"
            "python dev/gpu_card.py --fill-readmes gpu-card\n```")


def write_section(readme, content):
    """Replace the text between the markers; a README without the section gets one before its last section."""
    text = readme.read_text()
    block = f"{BEGIN_MARKER}\n{content}\n{END_MARKER}"
    if BEGIN_MARKER in text and END_MARKER in text:
        before, rest = text.split(BEGIN_MARKER, 1)
        after = rest.split(END_MARKER, 1)[1]
        readme.write_text(before + block + after)
        return
    lines = text.splitlines(keepends=True)
    in_code, headings = False, []
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            headings.append(index)
    section = f"{SECTION_TITLE}\n\n{block}\n\n"
    if headings:
        readme.write_text("".join(lines[:headings[-1]]) + section + "".join(lines[headings[-1]:]))
    else:
        readme.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
