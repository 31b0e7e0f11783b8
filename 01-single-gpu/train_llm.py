"""Chapter 01: train a Llama-style language model on one device.

Everything the later chapters build on is here: the data pipeline, the training step, timers and metrics,
and checkpoints that resume exactly. Read main() top to bottom; the helpers follow it in the same order.

    python 01-single-gpu/train_llm.py    # no GPU: the tiny model bundled in data/, on the CPU
    python 01-single-gpu/train_llm.py -m meta-llama/Llama-3.2-1B -d tatsu-lab/alpaca -e llama-1b    # on a GPU
"""

import argparse
import contextlib
import importlib.util
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
import uuid
import zlib
from pathlib import Path

import datasets
import torch
import wandb
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
LOGGER = logging.getLogger("train_llm")


def main():
    args = parse_args()
    setup_logging()
    LOGGER.info(f"arguments: {vars(args)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    auto_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = auto_dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    LOGGER.info(f"device: {device}, compute dtype: {dtype}")
    experiment_dir = Path(args.save_dir) / args.experiment_name
    experiment_dir.mkdir(parents=True, exist_ok=True)

    # 1. The model: built from its config (untrained), every parameter initialized from the seed.
    config = load_model_config(args.model_name)
    require(args.seq_length <= config.max_position_embeddings, f"--seq-length {args.seq_length} is longer than the "
            f"model's maximum of {config.max_position_embeddings} positions (max_position_embeddings); use a smaller "
            "--seq-length")
    flash_attn_ready = device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None
    require(args.attn_implementation != "flash_attention_2" or flash_attn_ready,
            "--attn-implementation flash_attention_2 needs a CUDA GPU and the flash-attn package (pip install "
            "flash-attn --no-build-isolation); use --attn-implementation sdpa instead")
    with device:
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_implementation(args.attn_implementation), dtype=torch.float32)
    init_weights(model, args.seed)
    num_params = sum(p.numel() for p in model.parameters())
    LOGGER.info(f"model: {num_params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers")

    # 2. The data: tokenized once, cut into fixed-length sequences, cached on disk.
    tokenizer = load_tokenizer(args.model_name)
    dataset = load_and_tokenize_dataset(args, tokenizer)
    samples_per_step = args.batch_size * args.grad_accum
    steps_per_epoch = len(dataset) // samples_per_step
    require(len(dataset) >= samples_per_step, f"the data set has {len(dataset)} sequences of {args.seq_length} "
            f"tokens, fewer than the {samples_per_step} one optimizer step needs; use more data or a smaller "
            "--batch-size, --grad-accum or --seq-length")
    LOGGER.info(f"data: {len(dataset)} sequences of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # 3. The optimizer and the learning rate schedule.
    # NOTE: fused=True runs AdamW's whole update as one kernel per group of tensors, on the GPU and on the CPU alike.
    adamw_options = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_options)
    max_steps = args.max_steps if args.num_epochs is None else args.num_epochs * steps_per_epoch
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_lr_factor(step, args.warmup_steps, max_steps))

    # 4. Resume: if the experiment directory holds a checkpoint, training continues from it.
    train_state = {"step": 0, "epoch": 0, "samples_seen_in_epoch": 0}
    checkpoint_dir = find_latest_checkpoint(experiment_dir)
    if checkpoint_dir is not None:
        train_state = load_checkpoint(checkpoint_dir, model, optimizer, lr_scheduler, config, device)
        LOGGER.info(f"resumed from {checkpoint_dir} at step {train_state['step']}")

    # 5. Experiment tracking: wandb (online if you are logged in, offline otherwise) and metrics.jsonl.
    wandb.init(project=args.wandb_project, name=args.experiment_name, id=get_wandb_run_id(experiment_dir),
               resume="allow", dir=experiment_dir, mode=get_wandb_mode(args.wandb_mode), config=vars(args))
    metrics_file = open(experiment_dir / "metrics.jsonl", "a")
    flops_per_token = get_flops_per_token(model, config, args.seq_length)
    peak_flops = get_peak_flops(device, dtype)

    # 6. The training loop.
    model.train()
    progress_bar = tqdm(total=max_steps, initial=train_state["step"], desc="training", unit="step", dynamic_ncols=True)
    steps_this_run, tokens_since_log, time_of_last_log = 0, 0, time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    done = train_state["step"] >= max_steps
    while not done:
        dataloader = get_dataloader(dataset, args, train_state["epoch"], train_state["samples_seen_in_epoch"], device)
        micro_batches = iter(dataloader)
        for _ in range(len(dataloader) // args.grad_accum):
            timer = StepTimer(device)
            step_loss = torch.zeros((), device=device)
            for _ in range(args.grad_accum):
                with timer("data"):
                    input_ids = next(micro_batches)["input_ids"].to(device, non_blocking=True)
                    attention_kwargs = get_attention_kwargs(args.attn_implementation, input_ids)
                with timer("forward"), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    # NOTE: Hugging Face models shift the labels inside: token t is trained to predict token t + 1.
                    # use_cache=False: no KV cache. Only generation needs one; in training it would keep every
                    # layer's keys and values alive (twice, for a layer that activation checkpointing recomputes).
                    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False,
                                 **attention_kwargs).loss / args.grad_accum
                with timer("backward"):
                    loss.backward()
                # NOTE: .detach() keeps the loss on the device. Calling .item() here would make the CPU wait for
                # the GPU to finish every step; we read the value only on logging steps.
                step_loss += loss.detach()
            with timer("update"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            train_state["step"] += 1
            train_state["samples_seen_in_epoch"] += samples_per_step
            steps_this_run += 1
            tokens_since_log += samples_per_step * args.seq_length
            progress_bar.update()
            step = train_state["step"]
            done = step == max_steps or steps_this_run == args.exit_after_steps

            if step % args.log_freq == 0 or done:
                # NOTE: .item() waits for the device to finish the step: the only synchronization in a step. Only
                # after it does the wall clock measure the GPU's work, not how fast the CPU queued the kernels.
                loss_value = step_loss.item()
                tokens_per_second = tokens_since_log / (time.perf_counter() - time_of_last_log)
                tokens_since_log, time_of_last_log = 0, time.perf_counter()
                record = {
                    "step": step, "epoch": train_state["epoch"], "loss": loss_value, "lr": lr_scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm.item(), "tokens_per_second": tokens_per_second,
                    "mfu": tokens_per_second * flops_per_token / peak_flops if peak_flops else None,
                    **get_memory_stats(device), **{f"time_{name}_ms": ms for name, ms in timer.read_ms().items()},
                }
                log_metrics(record, metrics_file)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)

            if step % args.ckpt_freq == 0 or done:
                save_checkpoint(experiment_dir, model, optimizer, lr_scheduler, train_state, config)
            if done:
                break
        if not done:
            # NOTE: the data loader ran out: the epoch is over.
            train_state["epoch"] += 1
            train_state["samples_seen_in_epoch"] = 0

    progress_bar.close()
    metrics_file.close()
    wandb.finish()
    LOGGER.info(f"done: step {train_state['step']} of {max_steps}")


# Arguments and logging


def get_parser():
    parser = argparse.ArgumentParser(description="Train a Llama-style causal language model on one GPU, or on the CPU.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model_and_data = parser.add_argument_group("model and data")
    model_and_data.add_argument("-m", "--model-name", default=str(REPO_ROOT / "data" / "tiny-llama"),
                                help="Hugging Face hub name or local folder with config.json and the tokenizer")
    model_and_data.add_argument("-d", "--dataset-name", default=str(REPO_ROOT / "data" / "tiny-shakespeare"),
                                help="Hugging Face hub name, or local folder or file (.jsonl .json .csv .txt .parquet)")
    model_and_data.add_argument("--dataset-subset", help="the data set's configuration name, if it has several")
    model_and_data.add_argument("--text-column", default="text", help="the data set's column that holds the text")
    model_and_data.add_argument("--seq-length", type=int, default=256, help="tokens per training sequence")
    model_and_data.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                                help="compute dtype; auto is bfloat16 on CUDA and float32 on CPU")
    model_and_data.add_argument("--attn-implementation", choices=["sdpa", "eager", "flash_attention_2"], default="sdpa")
    model_and_data.add_argument("--num-workers", type=int, default=1, help="data loader worker processes")
    training = parser.add_argument_group("training")
    training.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the sample order")
    training.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    training.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    training.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    training.add_argument("--warmup-steps", type=int, default=20, help="steps of linear warm-up before cosine decay")
    training.add_argument("--weight-decay", type=float, default=0.1)
    training.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping threshold")
    training.add_argument("--max-steps", type=int, default=200,
                          help="total optimizer steps; a resumed run stops where an uninterrupted one would")
    training.add_argument("--num-epochs", type=int, help="passes over the data set to train, instead of --max-steps")
    training.add_argument("--exit-after-steps", type=int,
                          help="checkpoint and exit after this many steps of this run, e.g. to fit a job's time limit")
    checkpoints = parser.add_argument_group("checkpoints and logging")
    checkpoints.add_argument("-e", "--experiment-name", default="quickstart",
                             help="name of this run: its checkpoints and metrics go to SAVE_DIR/EXPERIMENT_NAME")
    checkpoints.add_argument("--save-dir", default="outputs", help="parent folder of all experiment folders")
    checkpoints.add_argument("--log-freq", type=int, default=10, help="log metrics every this many steps")
    checkpoints.add_argument("--ckpt-freq", type=int, default=100, help="save a checkpoint every this many steps")
    checkpoints.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None,
                             help="default: online if you are logged in to wandb, offline otherwise")
    checkpoints.add_argument("--wandb-project", default="distributed-training-guide")
    return parser


def parse_args():
    args = get_parser().parse_args()
    for name in ["seq_length", "batch_size", "grad_accum", "max_steps", "num_epochs", "exit_after_steps", "log_freq",
                 "ckpt_freq"]:
        value = getattr(args, name)
        require(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    require(args.warmup_steps >= 0 and args.num_workers >= 0, "--warmup-steps and --num-workers cannot be negative")
    return args


def fail(message):
    """Stop with a one-line error on stderr and exit status 1: for mistakes in the input, not bugs."""
    raise SystemExit(f"error: {message}")


def require(condition, message):
    """An input rule, stated where the input is used: fail(message) unless the condition holds."""
    if not condition:
        fail(message)


def setup_logging():
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO,
                        stream=sys.stdout)


# 1. The model


def load_model_config(model_name):
    try:
        return AutoConfig.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"cannot load a model config from {model_name!r} ({first_line}); "
             "pass -m a local folder with config.json or a Hugging Face hub name like meta-llama/Llama-3.1-8B")


def attention_implementation(attn_implementation):
    """The attention implementation to build the model with: "sdpa" registered again under a name without masks.

    NOTE: for "sdpa", transformers' mask creation reads position_ids on the host (packed sequences?): a sync in every
    forward. A name with no mask function gets no mask, and SDPA runs with is_causal=True, as "sdpa" does after it.
    """
    if attn_implementation != "sdpa":
        return attn_implementation
    AttentionInterface.register("causal_sdpa", AttentionInterface()["sdpa"])
    return "causal_sdpa"


def get_attention_kwargs(attn_implementation, input_ids):
    """What the model's forward needs besides the tokens: for flash attention, where each sequence begins and ends.

    NOTE: without them, transformers' flash-attention path checks, at batch size 1, whether position_ids pack several
    sequences into one row, reading position_ids on the host: a host-device sync in every layer of every forward and a
    graph break in every compiled one. Given the boundaries (cu_seq_lens: every sequence is seq_length tokens) and the
    longest length, it calls flash_attn_varlen_func directly: the same causal attention. SDPA and eager need nothing.
    """
    if attn_implementation != "flash_attention_2":
        return {}
    batch_size, seq_length = input_ids.shape
    boundaries = torch.arange(0, (batch_size + 1) * seq_length, seq_length, dtype=torch.int32, device=input_ids.device)
    return dict(cu_seq_lens_q=boundaries, cu_seq_lens_k=boundaries, max_length_q=seq_length, max_length_k=seq_length)


@torch.no_grad()
def init_weights(model, seed):
    """Initialize every parameter from a generator seeded with the seed and the parameter's name.

    NOTE: each parameter's values depend only on (seed, name, device type), not on the order in which parameters
    are created or on how the model is split: every later chapter, however it splits the model across GPUs, starts
    from this one's weights and reproduces its loss curve. (CPU and CUDA generators differ: compare GPU with GPU.)
    """
    std = model.config.initializer_range
    for name, param in model.named_parameters():
        generator = torch.Generator(param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):
            full_value = torch.ones(param.shape, device=param.device)
        else:
            full_value = torch.empty(param.shape, device=param.device).normal_(mean=0.0, std=std, generator=generator)
        param.copy_(full_value)


# 2. The data


def load_tokenizer(model_name):
    try:
        return AutoTokenizer.from_pretrained(model_name)
    except (OSError, ValueError) as error:
        first_line = str(error).strip().splitlines()[0]
        fail(f"cannot load a tokenizer from {model_name!r} ({first_line}); the model folder must hold tokenizer files")


def load_and_tokenize_dataset(args, tokenizer):
    """Tokenize every document, join them with an end-of-text token, and cut the stream into seq_length chunks.

    The result is saved on disk, keyed by everything it depends on, so the next run loads it in a second.
    """
    key = json.dumps([args.dataset_name, args.dataset_subset, args.text_column, tokenizer.name_or_path,
                      len(tokenizer), args.seq_length])
    cache_dir = Path(datasets.config.HF_DATASETS_CACHE) / "train_llm" / f"{zlib.crc32(key.encode()):08x}"
    if not cache_dir.exists():
        LOGGER.info(f"tokenizing {args.dataset_name} into {cache_dir}")
        raw_dataset = load_raw_dataset(args.dataset_name, args.dataset_subset)
        columns = {name: getattr(feature, "dtype", "nested") for name, feature in raw_dataset.features.items()}
        require(columns.get(args.text_column) in ("string", "large_string"), f"the data set has no column "
                f"{args.text_column!r} of text (its columns: {columns}); pass --text-column with the column of text")
        tokenized = raw_dataset.map(
            lambda batch: {"input_ids": [ids + [tokenizer.eos_token_id] for ids in tokenizer(batch[args.text_column])["input_ids"]]},
            batched=True, remove_columns=raw_dataset.column_names, desc="tokenizing")
        chunked = tokenized.map(lambda batch: {"input_ids": cut_into_chunks(batch["input_ids"], args.seq_length)},
                                batched=True, batch_size=10_000, desc="chunking")
        require(len(chunked) != 0, f"the data set holds fewer than --seq-length {args.seq_length} tokens; use more "
                "data or a smaller --seq-length")
        # NOTE: write to a temporary name and rename: a run killed half-way leaves no half-written cache behind.
        temporary_dir = cache_dir.with_name(f"{cache_dir.name}.tmp-{os.getpid()}")
        chunked.save_to_disk(temporary_dir)
        try:
            os.replace(temporary_dir, cache_dir)
        except OSError:
            # NOTE: another process finished the same cache first (e.g. on another node sharing this folder).
            shutil.rmtree(temporary_dir)
    return datasets.load_from_disk(cache_dir).with_format("torch")


def load_raw_dataset(dataset_name, dataset_subset):
    path = Path(dataset_name)
    try:
        if path.is_file():
            builder = {".jsonl": "json", ".txt": "text"}.get(path.suffix, path.suffix.lstrip("."))
            return datasets.load_dataset(builder, data_files=str(path), split="train")
        return datasets.load_dataset(dataset_name, dataset_subset, split="train")
    # NOTE: an empty file raises a bare StopIteration; a file that does not parse, a DatasetsError caused by why.
    except (OSError, ValueError, StopIteration, datasets.exceptions.DatasetsError) as error:
        first_line = (str(error.__cause__ or error).strip() or "it holds no data").splitlines()[0]
        fail(f"cannot load the data set {dataset_name!r} ({first_line}); pass -d a Hugging Face hub name like "
             "tatsu-lab/alpaca, or a file or folder of .jsonl, .json, .csv, .txt or .parquet files in those formats")


def cut_into_chunks(token_lists, seq_length):
    stream = [token for tokens in token_lists for token in tokens]
    return [stream[start:start + seq_length] for start in range(0, len(stream) - seq_length + 1, seq_length)]


def get_dataloader(dataset, args, epoch, samples_seen_in_epoch, device):
    """The batches of one epoch in a seeded random order, starting after the samples already trained on.

    NOTE: the order, drawn from (seed, epoch), is the same in every run; resuming cuts it at the next unseen sample.
    """
    generator = torch.Generator().manual_seed(args.seed + epoch)
    sample_order = torch.randperm(len(dataset), generator=generator).tolist()
    samples_per_step = args.batch_size * args.grad_accum
    num_samples = len(dataset) // samples_per_step * samples_per_step
    remaining = Subset(dataset, sample_order[samples_seen_in_epoch:num_samples])
    return DataLoader(remaining, batch_size=args.batch_size, num_workers=args.num_workers,
                      pin_memory=device.type == "cuda")


# 3. The optimizer and the learning rate schedule


def warmup_cosine_lr_factor(step, warmup_steps, max_steps, min_factor=0.1):
    """Linear warm-up from 0 to 1, then cosine decay to min_factor at max_steps (factors of the peak --lr)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


# 4. Checkpoints


def find_latest_checkpoint(experiment_dir):
    # NOTE: a checkpoint folder gets its final name only once it is complete, so any "checkpoint-*" is whole.
    checkpoints = sorted(experiment_dir.glob("checkpoint-*"))
    return checkpoints[-1] if checkpoints else None


def save_checkpoint(experiment_dir, model, optimizer, lr_scheduler, train_state, config):
    """Save everything needed to continue exactly: weights, optimizer moments, schedule, RNG, data position.

    NOTE: the files are written into a temporary folder that is renamed once complete. A crash during the save
    leaves the previous checkpoint untouched; older checkpoints are deleted only after the new one exists.
    """
    final_dir = experiment_dir / f"checkpoint-{train_state['step']:08d}"
    temporary_dir = experiment_dir / f"tmp-{final_dir.name}"
    shutil.rmtree(temporary_dir, ignore_errors=True)
    temporary_dir.mkdir()
    torch.save(model.state_dict(), temporary_dir / "model.pt")
    torch.save(optimizer.state_dict(), temporary_dir / "optimizer.pt")
    torch.save({"lr_scheduler": lr_scheduler.state_dict(), "rng": get_rng_state(), **train_state},
               temporary_dir / "train_state.pt")
    (temporary_dir / "model_config.json").write_text(config.to_json_string())
    # NOTE: where -m came from (a local folder made absolute): convert_to_hf.py saves its tokenizer with the weights.
    model_name = str(Path(config.name_or_path).resolve()) if Path(config.name_or_path).is_dir() else config.name_or_path
    (temporary_dir / "model_source.json").write_text(json.dumps({"model_name": model_name}) + "\n")
    shutil.rmtree(final_dir, ignore_errors=True)
    os.replace(temporary_dir, final_dir)
    for old_dir in experiment_dir.glob("checkpoint-*"):
        if old_dir != final_dir:
            shutil.rmtree(old_dir)
    LOGGER.info(f"saved {final_dir}")


def load_checkpoint(checkpoint_dir, model, optimizer, lr_scheduler, config, device):
    saved_config = json.loads((checkpoint_dir / "model_config.json").read_text())
    shape_keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads"]
    different = [f"{key} {saved_config.get(key)} vs {getattr(config, key, None)}"
                 for key in shape_keys if saved_config.get(key) != getattr(config, key, None)]
    require(not different, f"the checkpoint {checkpoint_dir} was saved from a different model "
            f"({', '.join(different)}); use another --experiment-name or --save-dir, or the model it was trained with")
    # NOTE: weights_only=True refuses to unpickle arbitrary objects, so a checkpoint cannot run code on load.
    # Without map_location, tensors go back to the device they were saved from: cuda:0 for rank 0 of a GPU job, so
    # a node's 8 processes would all load onto GPU 0. Weights and moments go to this process's device, RNG to the CPU.
    model.load_state_dict(torch.load(checkpoint_dir / "model.pt", map_location=device, weights_only=True))
    optimizer.load_state_dict(torch.load(checkpoint_dir / "optimizer.pt", map_location=device, weights_only=True))
    train_state = torch.load(checkpoint_dir / "train_state.pt", map_location="cpu", weights_only=True)
    lr_scheduler.load_state_dict(train_state.pop("lr_scheduler"))
    set_rng_state(train_state.pop("rng"))
    return train_state


# NOTE: the CUDA state of this process's GPU only (the current device): a run may resume with fewer GPUs visible.
def get_rng_state():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_rng_state(rng_state):
    torch.set_rng_state(rng_state["cpu"])
    if torch.is_tensor(rng_state["cuda"]) and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng_state["cuda"])


# 5. Experiment tracking


def get_wandb_mode(requested_mode):
    """Online if you are logged in to wandb, offline otherwise: never stop and ask for an API key."""
    return requested_mode or os.environ.get("WANDB_MODE") or ("online" if wandb.login(prompt=False, verify=False)
                                                              else "offline")


def get_wandb_run_id(experiment_dir):
    """One wandb run per experiment: a resumed run keeps appending to the same run."""
    id_file = experiment_dir / "wandb_run_id.txt"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:12])
    return id_file.read_text().strip()


def get_flops_per_token(model, config, seq_length):
    """Training FLOPs per token: 6 per weight (forward 2, backward 4) plus attention's score and value matmuls.

    The formula is the one of the PaLM paper (appendix B) and torchtitan: 6 * N + 12 * L * H * Q * T, with N the
    parameters that do matmuls, L layers, H heads, Q the head dimension and T the sequence length.
    """
    num_params = sum(p.numel() for p in model.parameters())
    # NOTE: the input embedding is a lookup, not a matmul: no FLOPs, unless tied to the output head (Llama 3.2 1B, 3B).
    if not config.tie_word_embeddings:
        num_params -= model.get_input_embeddings().weight.numel()
    # NOTE: the config's head_dim where it states one: Qwen3's and Mistral-Nemo's heads are not hidden_size / heads.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 6 * num_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length


# Dense bf16 tensor-core peak, in FLOP/s: NVIDIA's data sheets (half their "with sparsity" figures; A10G: AWS's).
PEAK_BF16_FLOPS = {"H200 NVL": 835e12, "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
                   "A100": 312e12, "L40S": 362e12, "L40": 181e12, "L4": 121e12, "A10G": 70e12, "B200": 2250e12}


def get_peak_flops(device, dtype):
    """Peak FLOP/s for the MFU denominator, or None where we do not know it (the CPU, an unlisted GPU, fp32)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    device_name = torch.cuda.get_device_name(device)
    # NOTE: the longest name first: "NVIDIA L40S" contains "L4" and "L40", "H100 NVL" contains "H100".
    for gpu in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if gpu in device_name:
            return PEAK_BF16_FLOPS[gpu]
    LOGGER.warning(f"no peak FLOP/s known for {device_name!r}: MFU will be n/a (add it to PEAK_BF16_FLOPS)")
    return None


def get_memory_stats(device):
    if device.type == "cuda":
        return {"memory_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "memory_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
    # NOTE: on Linux ru_maxrss is in kilobytes (on macOS in bytes): the peak resident memory of this process.
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"memory_rss_gb": max_rss * (1 if sys.platform == "darwin" else 1024) / 1e9}


def log_metrics(record, metrics_file):
    mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.1%}"
    memory = " ".join(f"{key.removesuffix('_gb')} {value:.2f}GB" for key, value in record.items() if key.endswith("_gb"))
    times = " ".join(f"{key[5:-3]} {value:.0f}" for key, value in record.items() if key.startswith("time_"))
    LOGGER.info(f"step {record['step']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm "
                f"{record['grad_norm']:.3f} | {record['tokens_per_second']:,.0f} tokens/s | MFU {mfu} | {memory}"
                f" | ms: {times}")
    wandb.log(record, step=record["step"])
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()


class StepTimer:
    """Time the phases of a training step (data, forward, backward, update) without stalling the GPU.

    NOTE: CUDA kernels run asynchronously: time.perf_counter() around a GPU forward measures only the CPU queueing its
    kernels. CUDA events go into the GPU's stream instead, read once per logging step, after a single synchronization.
    """

    def __init__(self, device):
        self.use_cuda_events = device.type == "cuda"
        self.spans = []

    @contextlib.contextmanager
    def __call__(self, name):
        if self.use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.spans.append((name, start, end))

    def read_ms(self):
        """Milliseconds per phase, summed over micro-batches. Waits for the GPU: call it on logging steps only."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
        totals = {}
        for name, start, end in self.spans:
            milliseconds = start.elapsed_time(end) if self.use_cuda_events else (end - start) * 1000
            totals[name] = totals.get(name, 0.0) + milliseconds
        return totals


if __name__ == "__main__":
    main()
