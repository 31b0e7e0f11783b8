"""Chapter 06: tensor parallelism (TP), with DTensor: each rank holds a slice of every weight matrix and computes
its part of every matmul, exchanging activations inside each layer. All ranks train on one batch.

    torchrun --standalone --nproc-per-node 2 06-tensor-parallel/train_llm.py    # no GPU: 2 CPU processes
    torchrun --standalone --nproc-per-node 8 06-tensor-parallel/train_llm.py \\
        -m meta-llama/Llama-3.1-8B -d tatsu-lab/alpaca -e llama-8b-tp    # one node of 8 GPUs
"""

import argparse
import atexit
import contextlib
import datetime
import fnmatch
import functools
import json
import logging
import math
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

import datasets
import huggingface_hub
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import wandb
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils.data import DataLoader, DistributedSampler, Subset
from tqdm import tqdm
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
LOGGER = logging.getLogger("train_llm")


# NOTE: @record: torchrun's error summary shows this rank's exception.
@record
def main():
    args = parse_args()
    launcher, rank, local_rank, world_size = get_distributed_environment(args.rdzv_timeout)
    setup_logging(rank)
    LOGGER.info(f"arguments: {vars(args)}")
    LOGGER.info(f"started by {launcher} on {socket.gethostname()}, rendezvous at {os.environ['MASTER_ADDR']}:"
                f"{os.environ['MASTER_PORT']}")
    timeout = datetime.timedelta(seconds=args.dist_timeout)
    device = get_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", timeout=timeout)
    auto_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto_dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    LOGGER.info(f"rank {rank} of {world_size} (local rank {local_rank}), device: {device}, compute dtype: {dtype}")
    experiment_dir = Path(args.save_dir) / args.experiment_name
    experiment_dir.mkdir(parents=True, exist_ok=True)

    # 1. The model: built empty, sharded, then filled with its pretrained weights (or from the seed if it has none).
    with rank_zero_first(), explain_load_errors(f"-m {args.model_name}", "pass a hub name or a model folder"):
        model_dir = download_model(args.model_name)
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    require(args.seq_length <= config.max_position_embeddings,
            f"--seq-length {args.seq_length} exceeds the model's {config.max_position_embeddings} positions")
    require(dtype != torch.float32 or device.type != "cuda" or fused_attention_runs(config, device, dtype),
            "--dtype float32 on CUDA: no fused attention kernel takes the model's heads; use --dtype bfloat16 or auto")
    require(not getattr(config, "output_router_logits", False), "the model adds its experts' load-balancing loss "
            "(output_router_logits) over each rank's tokens, not the global batch's; set it false, or use chapter 10")
    tp_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementation(config, args.seq_length), dtype=torch.float32)
    require(isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleList),
            f"{config.model_type} has no model.layers to split; use chapter 02")
    check_tensor_parallel_degree(world_size, config, args.seq_length)
    parallelize_model(model, tp_mesh)
    # NOTE: each checkpoint holds a compiled forward: TP's collectives in a layer are compiled, and recomputed.
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)
    if args.compile:
        compile_layers(model)
    to_empty_keeping_buffers(model, device, cpu_offload=False)
    # NOTE: a resumed run takes its weights from its checkpoint, not the pretrained ones.
    checkpoint_dir = find_latest_checkpoint_on_rank_zero(experiment_dir)
    if checkpoint_dir is None and find_weight_files(model_dir):
        load_pretrained_weights(model, model_dir)
    elif checkpoint_dir is None:
        LOGGER.info(f"no *.safetensors weights in {model_dir}: every parameter from the seed")
        init_weights(model, args.seed)
    LOGGER.info(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")

    # 2. The data: tokenized once, cut into sequences, cached on disk.
    with rank_zero_first():
        dataset = load_and_tokenize_dataset(args, tokenizer)
    # NOTE: the ranks compute one model, so they all read the same batch: for the data, one replica (rank 0 of 1).
    args.grad_accum = grad_accum_steps(args, 1)
    samples_per_step = args.batch_size * args.grad_accum
    steps_per_epoch = len(dataset) // samples_per_step
    require(steps_per_epoch > 0, f"{len(dataset)} sequences are fewer than one step's {samples_per_step}; use more "
            "data or a smaller --batch-size, --grad-accum or --seq-length")
    LOGGER.info(f"data: {len(dataset)} sequences of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # 3. The optimizer and the learning rate schedule.
    # NOTE: fused=True: one kernel per group of tensors.
    adamw_options = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    # NOTE: the parameters are this rank's slices, so AdamW's moments are sliced too.
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_options)
    max_steps = args.max_steps if args.num_epochs is None else args.num_epochs * steps_per_epoch
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_lr_factor(step, args.warmup_steps, max_steps))

    # 4. Resume from the latest checkpoint, if any.
    checkpoint_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=args.ckpt_timeout))
    background_save = BackgroundSave(dist.new_group(backend="gloo", timeout=datetime.timedelta(
        seconds=args.ckpt_timeout))) if args.async_checkpoint else None
    train_state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    if checkpoint_dir is not None:
        train_state = load_checkpoint(checkpoint_dir, model, optimizer, lr_scheduler, config, checkpoint_group)
        LOGGER.info(f"resumed from {checkpoint_dir} at step {train_state['step']}")

    # 5. Experiment tracking: wandb and metrics.jsonl, on rank 0.
    if rank == 0:
        wandb.init(project=args.wandb_project, name=args.experiment_name, id=get_wandb_run_id(experiment_dir),
                   resume="allow", dir=experiment_dir, mode=get_wandb_mode(args.wandb_mode), config=vars(args))
        metrics_file = open(experiment_dir / "metrics.jsonl", "a")
    flops_per_token = get_flops_per_token(model, config, args.seq_length)
    peak_flops = get_peak_flops(device, dtype)

    # 6. The training loop.
    model.train()
    micro_batches = get_micro_batches(dataset, args, train_state, device, 0, 1)
    # NOTE: stops its DataLoader workers at exit: they only note Python's SIGTERM.
    atexit.register(micro_batches.close)
    first_step = train_state["step"] + 1
    last_step = min(max_steps, train_state["step"] + (args.exit_after_steps or max_steps))
    progress_bar = tqdm(total=max_steps, initial=train_state["step"], unit="step", dynamic_ncols=True,
                        disable=rank != 0)
    read_and_reset_memory_stats(device)
    tokens_since_log, time_of_last_log = 0, time.perf_counter()
    stop_signals, stop_group = catch_stop_signals(), dist.new_group(backend="gloo", timeout=timeout)
    agreed_to_stop = lambda: False
    for step in range(first_step, last_step + 1):
        step_loss = torch.zeros((), device=device)
        for _ in range(args.grad_accum):
            input_ids = next(micro_batches)["input_ids"].to(device, non_blocking=True)
            # NOTE: autocast, as no FSDP casts the weights. The loss reads logits split by vocabulary.
            with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss / args.grad_accum
            loss.backward()
            # NOTE: .detach(), not .item(): no wait for the GPU.
            step_loss += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        if step == first_step:
            log_memory_held(model, optimizer)
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_state["step"] = step
        train_state["samples_seen_in_epoch"] += samples_per_step
        tokens_since_log += samples_per_step * args.seq_length
        progress_bar.update()
        # NOTE: a step's vote is counted during the next: all stop after the same step, no host waits.
        if agreed_to_stop():
            last_step = step
        elif step < last_step:
            agreed_to_stop = vote_to_stop(stop_signals, stop_group)

        if step % args.log_freq == 0 or step == last_step:
            # NOTE: the mean of the ranks' losses is the global batch's (gloo has no ReduceOp.AVG).
            dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
            step_loss /= world_size
            loss_value = step_loss.item()
            tokens_per_second = tokens_since_log / (time.perf_counter() - time_of_last_log)
            tokens_since_log, time_of_last_log = 0, time.perf_counter()
            record = {
                "step": step, "epoch": train_state["epoch"], "loss": loss_value, "lr": lr_scheduler.get_last_lr()[0],
                "grad_norm": grad_norm.item(), "tokens_per_second": tokens_per_second,
                "mfu": tokens_per_second * flops_per_token / (peak_flops * world_size) if peak_flops else None,
                **read_and_reset_memory_stats(device)}
            if rank == 0:
                log_metrics(metrics_file, record)
        if background_save is not None:
            background_save.poll()
        if step % args.ckpt_freq == 0 or step == last_step:
            save_checkpoint(experiment_dir, model, optimizer, lr_scheduler, train_state, config, rank, checkpoint_group,
                            background_save)
        if step == last_step:
            break

    if background_save is not None:
        background_save.wait()
        # NOTE: rank 0 renames the last checkpoint complete; no rank exits before (a launcher may then stop it).
        dist.barrier(group=checkpoint_group)
    progress_bar.close()
    if rank == 0:
        metrics_file.close()
        wandb.finish()
    LOGGER.info(f"done: step {train_state['step']} of {max_steps}")
    dist.destroy_process_group()


# Arguments and logging


def get_parser():
    parser = argparse.ArgumentParser(
        description="Train a Llama-style language model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    group = parser.add_argument_group("model and data")
    group.add_argument("-m", "--model-name", default=str(REPO_ROOT / "data" / "tiny-llama"),
                       help="hub name, or folder with config.json, the tokenizer and any *.safetensors")
    group.add_argument("-d", "--dataset-name", default=str(REPO_ROOT / "data" / "tiny-shakespeare"),
                       help="hub name, or a folder or file (.jsonl .json .csv .txt .parquet)")
    group.add_argument("--dataset-subset", help="the configuration, if it has several")
    group.add_argument("--text-column", default="text")
    group.add_argument("--seq-length", type=int, default=256)
    group.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                       help="compute dtype; auto: bfloat16 on CUDA, float32 on CPU")
    group.add_argument("--num-workers", type=int, default=1)
    group = parser.add_argument_group("training")
    group.add_argument("--seed", type=int, default=0, help="of the weights and the sample order")
    group.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    group.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    group.add_argument("--global-batch-size", type=int, help="sequences per step over all ranks (sets --grad-accum)")
    group.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    group.add_argument("--warmup-steps", type=int, default=20, help="before the cosine decay")
    group.add_argument("--weight-decay", type=float, default=0.1)
    group.add_argument("--max-grad-norm", type=float, default=1.0)
    group.add_argument("--max-steps", type=int, default=200, help="optimizer steps, resumes included")
    group.add_argument("--num-epochs", type=int, help="passes over the data, instead of --max-steps")
    group.add_argument("--exit-after-steps", type=int, help="checkpoint and exit after this many steps")
    group.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    group.add_argument("--compile", action="store_true", help="compile each decoder layer with torch.compile")
    group = parser.add_argument_group("checkpoints and logging")
    group.add_argument("-e", "--experiment-name", default=Path(__file__).parent.name,
                       help="outputs go to SAVE_DIR/EXPERIMENT_NAME")
    group.add_argument("--save-dir", default="outputs")
    group.add_argument("--log-freq", type=int, default=10)
    group.add_argument("--ckpt-freq", type=int, default=100)
    group.add_argument("--ckpt-timeout", type=int, default=3600, help="seconds a checkpoint may take to save or load")
    group.add_argument("--async-checkpoint", action="store_true",
                       help="write the shards in the background, from a copy in host memory")
    group.add_argument("--wandb-mode", choices=["online", "offline", "disabled"],
                       help="default: online if logged in, else offline")
    group.add_argument("--wandb-project", default="distributed-training-guide")
    group = parser.add_argument_group("parallelism")
    group.add_argument("--dist-timeout", type=int, default=600, help="seconds a collective waits before the job fails")
    group.add_argument("--rdzv-timeout", type=int, default=300, help="seconds to wait for rank 0 (srun, mpirun)")
    return parser


def parse_args():
    args = get_parser().parse_args()
    for name in ["seq_length", "batch_size", "grad_accum", "global_batch_size", "max_steps", "num_epochs",
                 "exit_after_steps", "log_freq", "ckpt_freq", "dist_timeout", "ckpt_timeout"]:
        value = getattr(args, name)
        require(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    require(args.warmup_steps >= 0 and args.num_workers >= 0, "--warmup-steps and --num-workers cannot be negative")
    return args


def require(condition, message):
    if not condition:
        raise SystemExit(f"error: {message}")


def grad_accum_steps(args, dp_size):
    """--grad-accum, or the micro-steps that make --global-batch-size on dp_size data-parallel ranks."""
    if args.global_batch_size is None:
        return args.grad_accum
    require(args.grad_accum == 1, "--global-batch-size sets --grad-accum; pass one of them")
    micro_steps, left = divmod(args.global_batch_size, args.batch_size * dp_size)
    require(micro_steps and not left, f"--global-batch-size {args.global_batch_size} is not a multiple of --batch-size "
            f"x {dp_size} data-parallel ranks; use a multiple of {args.batch_size * dp_size}")
    return micro_steps


@contextlib.contextmanager
def explain_load_errors(what, fix):
    # NOTE: every rank that fails prints its line.
    try:
        yield
    except (OSError, ValueError, StopIteration, datasets.exceptions.DatasetsError) as error:
        reason = (str(error.__cause__ or error).strip() or "it holds no data").splitlines()[0]
        require(False, f"cannot load {what} ({reason}); {fix}")


def get_distributed_environment(rdzv_timeout):
    environment = os.environ
    if "RANK" in environment and "WORLD_SIZE" in environment:
        launcher = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in environment:
        launcher = "mpirun"
        environment.update(RANK=environment["OMPI_COMM_WORLD_RANK"], WORLD_SIZE=environment["OMPI_COMM_WORLD_SIZE"],
                           LOCAL_RANK=environment["OMPI_COMM_WORLD_LOCAL_RANK"])
    elif int(environment.get("SLURM_STEP_NUM_TASKS", 1)) > 1:
        # NOTE: srun's tasks; a batch script's shell has SLURM_PROCID too, but is one process.
        launcher = "srun"
        environment.update(RANK=environment["SLURM_PROCID"], WORLD_SIZE=environment["SLURM_STEP_NUM_TASKS"],
                           LOCAL_RANK=environment["SLURM_LOCALID"])
    else:
        launcher = "python (one process)"
        environment.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        environment.setdefault("MASTER_PORT", str(find_free_port()))
    # NOTE: restarted workers hang or fail on the agent's TCP store (pytorch #135712, #167288).
    require(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
            != "True", "--max-restarts hangs: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or drop --max-restarts")
    require("MASTER_ADDR" in environment and "MASTER_PORT" in environment,
            f"{launcher} without MASTER_ADDR and MASTER_PORT: export them in the job script (see job-srun.sbatch)")
    rank = int(environment["RANK"])
    if launcher in ("srun", "mpirun") and rank != 0:
        wait_for_rendezvous(environment["MASTER_ADDR"], int(environment["MASTER_PORT"]), rdzv_timeout, rank)
    return launcher, rank, int(environment["LOCAL_RANK"]), int(environment["WORLD_SIZE"])


def wait_for_rendezvous(host, port, timeout, rank):
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError as error:
            require(time.monotonic() <= deadline, f"rank {rank} on {socket.gethostname()} cannot reach {host}:{port} "
                    f"in {timeout}s ({error}); check MASTER_ADDR, MASTER_PORT and the firewall")
            time.sleep(1)


def find_free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def setup_logging(rank):
    logging.basicConfig(format=f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stdout)


def get_device(local_rank):
    # NOTE: a process that sees one GPU finds it at cuda:0, whatever its local rank.
    # NOTE: srun binds one GPU to each task with --gpus-per-task=1.
    if not torch.cuda.is_available():
        return torch.device("cpu")
    num_gpus = torch.cuda.device_count()
    require(num_gpus <= 1 or local_rank < num_gpus, f"local rank {local_rank}, but only {num_gpus} GPUs visible: start "
            "at most one process per GPU")
    return torch.device("cuda", local_rank if num_gpus > 1 else 0)


@contextlib.contextmanager
def rank_zero_first():
    waiting_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    rank_zero_error = [None]
    if dist.get_rank() != 0:
        dist.broadcast_object_list(rank_zero_error, src=0, group=waiting_group)
        require(rank_zero_error[0] is None, rank_zero_error[0])
    try:
        yield
    except BaseException as error:
        rank_zero_error[0] = (str(error).removeprefix("error: ") if isinstance(error, SystemExit)
                              else f"rank 0 failed ({type(error).__name__}: {error}); see its traceback")
        raise
    finally:
        if dist.get_rank() == 0:
            dist.broadcast_object_list(rank_zero_error, src=0, group=waiting_group)
        dist.destroy_process_group(waiting_group)


# 1. The model


# Skipped: weights in another format (405B's original/*.pth, 800 GB; Mistral's consolidated*).
MODEL_FILES = ["*.json", "*.safetensors", "tokenizer*"]
SKIPPED_MODEL_FILES = ["original/*", "consolidated*.safetensors"]


def download_model(model_name):
    # NOTE: 405B is 800 GB: download.sh fetches it first, or the other ranks would wait hours.
    if Path(model_name).is_dir():
        return model_name
    return huggingface_hub.snapshot_download(model_name, allow_patterns=MODEL_FILES,
                                             ignore_patterns=SKIPPED_MODEL_FILES)


@contextlib.contextmanager
def parameters_on_meta():
    """Parameters on the meta device (no memory, no values), buffers real, as the model's code computes them (the
    rotary frequencies, a router's bias): accelerate's init_empty_weights."""
    register_parameter = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register_parameter


def attention_implementation(config, seq_length):
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    require(not window or seq_length <= window, f"--seq-length {seq_length} exceeds the model's sliding window "
            f"{window}; use at most {window}")
    AttentionInterface.register("causal_sdpa", AttentionInterface()["sdpa"])
    return "causal_sdpa"


def fused_attention_runs(config, device, dtype):
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    query, key = (torch.empty(1, heads, 64, head_dim, device=device, dtype=dtype)
                  for heads in (config.num_attention_heads, config.num_key_value_heads))
    params = torch.backends.cuda.SDPAParams(query, key, key, None, 0.0, True, True)
    return torch.backends.cuda.can_use_efficient_attention(params) or torch.backends.cuda.can_use_flash_attention(params)


def apply_activation_checkpointing(model):
    # NOTE: each layer keeps its input only, for a third more compute; get_state_dict() hides the wrapper's names.
    for name, layer in model.model.layers.named_children():
        model.model.layers.register_module(name, checkpoint_wrapper(layer))


def compile_layers(model):
    # NOTE: one graph for all layers, in each checkpoint; hooks stay eager (torch 2.13 drops a compiled TP hook's grad).
    for layer in model.model.layers.children():
        layer = getattr(layer, "_checkpoint_wrapped_module", layer)
        layer.forward = torch.compile(layer.forward, fullgraph=True)


@torch.no_grad()
def to_empty_keeping_buffers(model, device, cpu_offload):
    # NOTE: to_empty() leaves buffers uninitialized: they get back their built values.
    buffers = [(module, name, buffer) for module in model.modules()
               for name, buffer in module.named_buffers(recurse=False)]
    model.to_empty(device="cpu" if cpu_offload else device)
    for module, name, buffer in buffers:
        setattr(module, name, buffer.to(device))


def find_weight_files(model_dir):
    # NOTE: no *.safetensors (the tiny model): the seed's weights.
    found = sorted(path for path in Path(model_dir).glob("*.safetensors")
                   if not any(fnmatch.fnmatch(path.name, pattern) for pattern in SKIPPED_MODEL_FILES))
    pickled = sorted(path.name for pattern in ["pytorch_model*.bin", "*.pth"] for path in Path(model_dir).glob(pattern))
    require(found or not pickled, f"{model_dir} holds only pickled weights ({', '.join(pickled)}); write them as "
            "safetensors with transformers' save_pretrained() and pass -m that folder")
    return found


@torch.no_grad()
def load_pretrained_weights(model, model_dir):
    # NOTE: DCP reads the Hugging Face files as a checkpoint: each rank maps in its shards' slices.
    started = time.perf_counter()
    model_state = get_model_state_dict(model)
    if model.config.tie_word_embeddings:
        # NOTE: a tied head is the embedding matrix, saved once as model.embed_tokens.weight.
        del model_state["lm_head.weight"]
    # NOTE: the reader reads every *.safetensors in its folder: link the weight files only.
    with tempfile.TemporaryDirectory() as weights_dir:
        for path in find_weight_files(model_dir):
            os.symlink(path.resolve(), Path(weights_dir) / path.name)
        try:
            dcp.load(model_state, storage_reader=HuggingFaceStorageReader(weights_dir))
        except dcp.CheckpointException as error:
            # NOTE: DCP gathers every rank's exception; the first one says what is wrong.
            cause = str(next(iter(error.failures.values()))[0]).strip().splitlines()[0]
            require(False, f"cannot load the weights of {model_dir} ({cause}); its *.safetensors must hold every "
                    "weight its config.json describes")
    LOGGER.info(f"loaded the pretrained weights of {model_dir} in {time.perf_counter() - started:.1f}s")


def check_tensor_parallel_degree(degree, config, seq_length):
    sizes = (config.num_key_value_heads, config.intermediate_size, config.vocab_size, seq_length)
    require(all(size % degree == 0 for size in sizes), f"the tensor-parallel degree {degree} does not divide the "
            f"key/value heads, MLP width, vocabulary and --seq-length {sizes}; use a divisor of each")


def parallelize_model(model, tp_mesh):
    """Norms and residual adds on token slices, Shard(1); attention (whole heads) and MLP column- then row-wise; the
    logits and the loss split along the vocabulary."""
    parallelize_module(model, tp_mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True),
        "model.norm": SequenceParallel(use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
    })
    # NOTE: tensor parallelism gave a tied head a second matrix: tie it again.
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer, model.config))
    model.loss_function = functools.partial(vocab_parallel_loss, tp_group=tp_mesh.get_group())


def layer_plan(layer, config):
    """The plan of the modules this decoder layer has; a weight outside it stops the run before the first step."""
    token_slices = SequenceParallel(use_local_output=True)
    # NOTE: q/k norms (Qwen3, Gemma 3) normalize each head, dim 2: each rank its own heads.
    head_slices = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan = {
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.q_norm": head_slices,
        "self_attn.k_norm": head_slices,
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        **{name: token_slices for name, _ in layer.named_children() if name.endswith("layernorm")},
    }
    held = dict(layer.named_modules())
    unplanned = next((name for name, _ in layer.named_parameters() if name.rpartition(".")[0] not in plan), None)
    require(unplanned is None, f"tensor parallelism has no plan for {unplanned} of {type(layer).__name__}; train this "
            "model without it (chapters 04, 08, 09, 10)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name in ("self_attn.q_norm", "self_attn.k_norm"):
        require(name not in held or held[name].weight.shape == (head_dim,), f"{name} of {type(layer).__name__} "
                "normalizes all heads together, which tensor parallelism splits; train this model without it")
    return {key: style for key, style in plan.items() if key in held}


def vocab_parallel_loss(logits, labels, vocab_size, num_items_in_batch=None, shift_labels=None, tp_group=None,
                        **kwargs):
    """transformers' causal-LM loss (ForCausalLMLoss) of logits split along the vocabulary over tp_group."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    labelled = shift_labels.flatten() != -100
    losses = VocabParallelCrossEntropy.apply(logits.flatten(0, -2), shift_labels.flatten(), tp_group) * labelled
    return losses.sum() / (labelled.sum() if num_items_in_batch is None else num_items_in_batch)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Each token's cross-entropy from this rank's slice of its logits: the largest logit, the sum of exponentials
    and the label's logit all-reduced; the backward needs no collective."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        local_labels = labels - dist.get_rank(group) * logits.shape[-1]
        owned = (local_labels >= 0) & (local_labels < logits.shape[-1])
        local_labels = local_labels.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        largest = logits.amax(-1, keepdim=True).float()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        # NOTE: one fp32 copy of the logits: shifted, its label's entry read, then exponentiated in place.
        exponentials = logits.to(torch.float32, copy=True).sub_(largest)
        label_logits = exponentials.gather(-1, local_labels) * owned.unsqueeze(-1)
        sums = torch.cat([exponentials.exp_().sum(-1, keepdim=True), label_logits], -1)
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exponentials.div_(sums[:, :1]), local_labels, owned)
        ctx.logits_dtype = logits.dtype
        return sums[:, 0].log() - sums[:, 1]

    @staticmethod
    def backward(ctx, grad_losses):
        probabilities, local_labels, owned = ctx.saved_tensors
        # NOTE: d loss / d logits = softmax - one-hot(label), the 1 on the rank that holds the label.
        grad_logits = probabilities.mul_(grad_losses.unsqueeze(-1))
        grad_logits.scatter_add_(-1, local_labels, -(grad_losses * owned).unsqueeze(-1))
        return grad_logits.to(ctx.logits_dtype), None, None


@torch.no_grad()
def init_weights(model, seed):
    std = getattr(model.config, "initializer_range", None) or model.config.init_std
    for name, param in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        generator = torch.Generator(param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full_value = torch.empty(param.shape, device=param.device).normal_(0, std, generator=generator)
        full_value = torch.ones_like(full_value) if name.endswith("norm.weight") else full_value
        param.copy_(distribute_tensor(full_value, param.device_mesh, param.placements, src_data_rank=None))


# 2. The data


def load_and_tokenize_dataset(args, tokenizer):
    key = json.dumps([args.dataset_name, args.dataset_subset, args.text_column, tokenizer.name_or_path, len(tokenizer),
                      args.seq_length])
    cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / "train_llm" / f"{zlib.crc32(key.encode()):08x}"
    if not cache_dir.exists():
        LOGGER.info(f"tokenizing {args.dataset_name} into {cache_dir}")
        with explain_load_errors(f"-d {args.dataset_name}", "pass a hub name, or .jsonl .json .csv .txt .parquet"):
            raw_dataset = load_raw_dataset(args.dataset_name, args.dataset_subset)
        columns = {name: getattr(feature, "dtype", "nested") for name, feature in raw_dataset.features.items()}
        require(columns.get(args.text_column) in ("string", "large_string"),
                f"no text column {args.text_column!r} (columns: {columns}); pass --text-column")
        chunked = raw_dataset.map(lambda batch: {"input_ids": cut_into_chunks(
            tokenizer(batch[args.text_column])["input_ids"], tokenizer.eos_token_id, args.seq_length)},
            batched=True, batch_size=10_000, remove_columns=raw_dataset.column_names, desc="tokenizing")
        require(len(chunked), f"-d {args.dataset_name} has under --seq-length {args.seq_length} tokens; use more data")
        temporary_dir = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
        chunked.save_to_disk(temporary_dir)
        try:
            os.replace(temporary_dir, cache_dir)
        except OSError:
            shutil.rmtree(temporary_dir)
    return datasets.load_from_disk(cache_dir).with_format("torch")


def load_raw_dataset(dataset_name, dataset_subset):
    path = Path(dataset_name)
    if path.is_file():
        builder = {".jsonl": "json", ".txt": "text"}.get(path.suffix, path.suffix.lstrip("."))
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    return datasets.load_dataset(dataset_name, dataset_subset, split="train")


def cut_into_chunks(token_lists, eos_token_id, seq_length):
    stream = [token for tokens in token_lists for token in [*tokens, eos_token_id]]
    return [stream[start:start + seq_length] for start in range(0, len(stream) - seq_length + 1, seq_length)]


def get_micro_batches(dataset, args, train_state, device, rank, world_size):
    while True:
        yield from get_dataloader(dataset, args, train_state["epoch"], train_state["samples_seen_in_epoch"], device,
                                  rank, world_size)
        train_state["epoch"] += 1
        train_state["samples_seen_in_epoch"] = 0


def get_dataloader(dataset, args, epoch, samples_seen_in_epoch, device, rank, world_size):
    # NOTE: cut at the global position, then dealt out: a checkpoint resumes exactly on any world size.
    sample_order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(args.seed + epoch)).tolist()
    remaining = Subset(dataset, sample_order[samples_seen_in_epoch:])
    sampler = DistributedSampler(remaining, num_replicas=world_size, rank=rank, shuffle=False, drop_last=True)
    num_samples = len(sampler) - len(sampler) % (args.batch_size * args.grad_accum)
    return DataLoader(Subset(remaining, list(sampler)[:num_samples]), batch_size=args.batch_size,
                      num_workers=args.num_workers, pin_memory=device.type == "cuda",
                      worker_init_fn=catch_stop_signals)


# 3. The optimizer and the learning rate schedule


def warmup_cosine_lr_factor(step, warmup_steps, max_steps, min_factor=0.1):
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


# 4. Checkpoints


def find_latest_checkpoint(experiment_dir):
    # NOTE: a folder is named "checkpoint-*" only once complete.
    checkpoints = sorted(experiment_dir.glob("checkpoint-*"))
    return checkpoints[-1] if checkpoints else None


def find_latest_checkpoint_on_rank_zero(experiment_dir):
    choice = [find_latest_checkpoint(experiment_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def save_checkpoint(experiment_dir, model, optimizer, lr_scheduler, train_state, config, rank, group,
                    background_save=None):
    """Every rank writes its own shards with torch.distributed.checkpoint (DCP); rank 0 adds the small files."""
    started = time.perf_counter()
    temporary_dir = experiment_dir / f"tmp-checkpoint-{train_state['step']:08d}"
    if rank == 0:
        shutil.rmtree(temporary_dir, ignore_errors=True)
    dist.barrier(group=group)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # NOTE: the step's small state, for rank 0 to write once every rank's shards are.
    small_state = {"lr_scheduler": lr_scheduler.state_dict(), "rng": get_rng_state(), **train_state}

    def finish():
        if rank == 0:
            write_checkpoint(experiment_dir, small_state, config)

    if background_save is not None:
        background_save.start({"model": model_state, "optimizer": optimizer_state}, temporary_dir, finish)
        LOGGER.info(f"checkpoint of step {train_state['step']} staged in {time.perf_counter() - started:.2f}s")
        return
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary_dir, process_group=group)
    finish()
    dist.barrier(group=group)
    LOGGER.info(f"checkpoint of step {train_state['step']} took {time.perf_counter() - started:.2f}s")


class BackgroundSave:
    """--async-checkpoint: one save at a time, its shards written by a background thread; rank 0 finishes it."""

    def __init__(self, group):
        self.group, self.future, self.finish = group, None, None

    def start(self, state, checkpoint_id, finish):
        self.wait()
        # NOTE: every shard copied to host memory first: training on cannot change what is written.
        self.future = dcp.async_save(state, checkpoint_id=checkpoint_id, process_group=self.group)
        self.finish = finish

    def poll(self):
        # NOTE: at every step: done() is neither a collective nor a GPU sync.
        if self.future is not None and self.future.done():
            self.wait()

    def wait(self):
        if self.future is not None:
            self.future.result()
            self.future = None
            self.finish()


def write_checkpoint(experiment_dir, small_state, config):
    final_dir = experiment_dir / f"checkpoint-{small_state['step']:08d}"
    temporary_dir = experiment_dir / f"tmp-{final_dir.name}"
    torch.save(small_state, temporary_dir / "train_state.pt")
    (temporary_dir / "model_config.json").write_text(config.to_json_string())
    model_name = str(Path(config.name_or_path).resolve()) if Path(config.name_or_path).is_dir() else config.name_or_path
    (temporary_dir / "model_source.json").write_text(json.dumps({"model_name": model_name}) + "\n")
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(temporary_dir, final_dir)
    for old_dir in experiment_dir.glob("checkpoint-*"):
        if old_dir != final_dir:
            shutil.rmtree(old_dir)
    LOGGER.info(f"saved {final_dir}")


def load_checkpoint(checkpoint_dir, model, optimizer, lr_scheduler, config, group):
    saved = json.loads((checkpoint_dir / "model_config.json").read_text())
    different = [f"{key} {saved.get(key)} vs {getattr(config, key, None)}" for key in SHAPE_KEYS
                 if saved.get(key) != getattr(config, key, None)]
    require(not different, f"the checkpoint {checkpoint_dir} is of another model ({', '.join(different)}); use new -e")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoint_dir, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    # NOTE: the RNG states must be CPU tensors, whoever wrote them.
    train_state = torch.load(checkpoint_dir / "train_state.pt", map_location="cpu", weights_only=True)
    lr_scheduler.load_state_dict(train_state.pop("lr_scheduler"))
    set_rng_state(train_state.pop("rng"))
    return train_state


SHAPE_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads"]


# NOTE: this GPU's CUDA state only: a run may resume on fewer GPUs.
def get_rng_state():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(rng_state):
    torch.set_rng_state(rng_state["cpu"])
    if torch.is_tensor(rng_state["cuda"]) and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_state["cuda"])


def catch_stop_signals(worker_id=None):
    # NOTE: only noted, in DataLoader workers too (related-topics/preemption.md).
    stop_signals = []
    for signal_number in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signal_number, lambda number, frame: stop_signals.append(number))
    return stop_signals


def vote_to_stop(stop_signals, stop_group):
    # NOTE: every rank's signals summed, started now and read a step later, when it has arrived.
    votes = torch.tensor(len(stop_signals))
    vote = dist.all_reduce(votes, group=stop_group, async_op=True)
    return lambda: vote.wait() and votes.item() > 0


# 5. Experiment tracking


def get_wandb_mode(requested_mode):
    return requested_mode or os.environ.get("WANDB_MODE") or (
        "online" if wandb.login(prompt=False, verify=False) else "offline")


def get_wandb_run_id(experiment_dir):
    id_file = experiment_dir / "wandb_run_id.txt"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()


def get_flops_per_token(model, config, seq_length):
    num_params = sum(p.numel() for p in model.parameters()) - (
        0 if config.tie_word_embeddings else model.get_input_embeddings().weight.numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * num_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length


# Dense bf16 peak FLOP/s, from the data sheets.
PEAK_BF16_FLOPS = {"H200 NVL": 835e12, "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
                   "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12, "B200": 2250e12}


def get_peak_flops(device, dtype):
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    device_name = torch.cuda.get_device_name(device)
    # NOTE: longest first: "L40S" contains "L4".
    for gpu in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if gpu in device_name:
            return PEAK_BF16_FLOPS[gpu]
    LOGGER.warning(f"no peak FLOP/s known for {device_name!r}: add it to PEAK_BF16_FLOPS for MFU")


def read_and_reset_memory_stats(device):
    if device.type != "cuda":
        return {"memory_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9}
    stats = {"memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
             "memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def log_metrics(metrics_file, record):
    mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.1%}"
    memory = " ".join(f"{key[:-3]} {value:.2f}GB" for key, value in record.items() if key.endswith("_gb"))
    LOGGER.info(f"step {record['step']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm "
                f"{record['grad_norm']:.3f} | {record['tokens_per_second']:,.0f} tokens/s | MFU {mfu} | {memory}")
    wandb.log(record, step=record["step"])
    print(json.dumps(record), file=metrics_file, flush=True)


def log_memory_held(model, optimizer):
    def megabytes(tensors):
        return sum(getattr(tensor, "to_local", lambda: tensor)().nbytes for tensor in tensors) / 1e6

    moments = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
               and value.dim() > 0]
    LOGGER.info(f"memory held by this rank: parameters {megabytes(model.parameters()):.2f} MB, gradients "
                f"{megabytes(p.grad for p in model.parameters() if p.grad is not None):.2f} MB, optimizer state "
                f"{megabytes(moments):.2f} MB")


if __name__ == "__main__":
    main()
