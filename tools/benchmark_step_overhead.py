"""How much slower is a chapter's training step than a bare forward/backward/optimizer loop?

The chapter's step adds data loading, timers, the LR schedule, gradient clipping and logging around the same
model, batch and optimizer. This tool runs both and prints the step times and the overhead; the target is 5%.

    python tools/benchmark_step_overhead.py                           # chapter 01, tiny model, CPU
    python tools/benchmark_step_overhead.py --chapter 01-single-gpu -- -m meta-llama/Llama-3.2-1B --batch-size 4

Arguments after `--` go to the chapter's script (and set the bare loop's model, batch and sequence length).
The bare loop is a single process, like chapter 01.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chapter", default="01-single-gpu")
    parser.add_argument("--steps", type=int, default=30, help="steps measured, after as many warm-up steps")
    parser.add_argument("script_args", nargs="*", help="arguments for the chapter's script, after --")
    args = parser.parse_args()
    script_options = load_chapter_parser(args.chapter).parse_args(args.script_args)

    bare = bare_step_seconds(script_options, warmup_steps=args.steps, steps=args.steps)
    chapter = chapter_step_seconds(args.chapter, args.script_args, script_options, args.steps)
    print(json.dumps({"bare_step_ms": bare * 1e3, "chapter_step_ms": chapter * 1e3,
                      "overhead_percent": (chapter / bare - 1) * 100}))


def load_chapter_parser(chapter):
    sys.path.insert(0, str(REPO_ROOT / chapter))
    import train_llm  # noqa: E402  (the chapter's script, imported for its argument parser)

    return train_llm.get_parser()


def bare_step_seconds(options, warmup_steps, steps):
    """The least a training step can cost: forward, backward and AdamW on one fixed batch, nothing else."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" and options.dtype != "float32" else torch.float32
    config = AutoConfig.from_pretrained(options.model_name)
    with device:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=options.attn_implementation,
                                                 dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    input_ids = torch.randint(0, config.vocab_size, (options.batch_size, options.seq_length), device=device)
    for step in range(warmup_steps + steps):
        if step == warmup_steps:
            synchronize(device)
            started = time.perf_counter()
        for _ in range(options.grad_accum):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(input_ids=input_ids, labels=input_ids).loss / options.grad_accum
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return (time.perf_counter() - started) / steps


def chapter_step_seconds(chapter, script_args, script_options, steps):
    """The chapter's own step time: from its tokens/s over a log window of `steps` steps, after as many warm-up steps.

    Within a log window the script synchronizes only at its end, as the bare loop does.
    """
    with tempfile.TemporaryDirectory() as save_dir:
        command = [sys.executable, str(REPO_ROOT / chapter / "train_llm.py"), *script_args,
                   "--max-steps", str(2 * steps), "--log-freq", str(steps), "--ckpt-freq", str(10 ** 9),
                   "--save-dir", save_dir, "-e", "benchmark", "--wandb-mode", "disabled"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        last_window = json.loads((Path(save_dir) / "benchmark" / "metrics.jsonl").read_text().splitlines()[-1])
    tokens_per_step = script_options.batch_size * script_options.grad_accum * script_options.seq_length
    return tokens_per_step / last_window["tokens_per_second"]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
