"""What the framework scripts share with chapter 04, imported from its train_llm.py (not copied: a copy could drift).

The same arguments, the same initial weights (seeded by parameter name), the same samples in the same order on each
rank, the same learning-rate schedule: only the framework around the training loop differs.
"""

import importlib.util
import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent


def import_chapter(folder):
    # NOTE: imported by path: a chapter is a script, not a package. Its main() runs only as __main__.
    name = f"{folder.replace('-', '_')}_train_llm"
    spec = importlib.util.spec_from_file_location(name, REPO / folder / "train_llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ch04 = import_chapter("04-fully-sharded-data-parallel")

# The pieces the frameworks do not replace.
parse_args = ch04.parse_args                            # chapter 04's flags, checked as chapter 04 checks them
init_weights = ch04.init_weights                        # fills each rank's DTensor shards from (seed, name)
init_full_weights = import_chapter("01-single-gpu").init_weights  # the same values in a model not yet sharded
shard_model = ch04.shard_model                          # one fully_shard group per decoder layer, then the root
warmup_cosine_lr_factor = ch04.warmup_cosine_lr_factor
load_and_tokenize_dataset = ch04.load_and_tokenize_dataset
get_micro_batches = ch04.get_micro_batches              # seeded order, dealt out r, r + world_size, ...
require = ch04.require
LOGGER = logging.getLogger("train_llm")


def build_model_and_data(args):
    """The untrained model (full, on the CPU: the tiny model fits) and the tokenized dataset, as chapter 04 makes them.
    Call it in every process once the process group exists."""
    config = AutoConfig.from_pretrained(args.model_name)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=ch04.attention_implementation(config, args.seq_length), dtype=torch.float32)
    with ch04.rank_zero_first():
        dataset = load_and_tokenize_dataset(args, tokenizer)
    return config, model, dataset


def adamw_and_schedule(params, args, max_steps):
    """Chapter 04's AdamW options and warmup-cosine schedule."""
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=True)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_lr_factor(step, args.warmup_steps, max_steps))
    return optimizer, lr_scheduler


def log_metrics(metrics_file, record):
    """One line of metrics.jsonl, with the chapters' keys (step, loss, lr, grad_norm, ...)."""
    LOGGER.info(f"step {record['step']} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | grad norm "
                f"{record['grad_norm']:.3f} | {record['tokens_per_second']:,.0f} tokens/s")
    print(json.dumps(record), file=metrics_file, flush=True)
