"""How much slower is a chapter's training step than a bare forward/backward/optimizer loop?

The chapter's step adds data loading, the LR schedule, gradient clipping and logging around the same
model, batch and optimizer. This tool times both, each in a fresh process, alternately (bare, chapter, bare, chapter,
...) --repeats times, and prints the median step times, their ratio and the overhead; the target is 5%.

    python dev/benchmark_step_overhead.py                             # chapter 01, tiny model, CPU
    python dev/benchmark_step_overhead.py --chapter 04-fully-sharded-data-parallel -- \
        -m data/llama-3.2-1b-shape --seq-length 2048 --batch-size 4   # on a GPU

Arguments after `--` go to the chapter's script (and set the bare loop's model, batch, sequence length, dtype and
attention). The bare loop is one process, like chapter 01, in the dtype the chapter computes in and the same way:
under autocast, or for an FSDP chapter with its fully_shard() groups and MixedPrecisionPolicy on a group of one
process. The chapter runs under torchrun with --nproc processes (chapter 01 as a plain process). Both measure `--steps` steps after as many warm-up steps, with one synchronization
at the end of the measured steps: the chapter's last log window, from its own tokens/s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CARD_SITE = REPO_ROOT / "dev" / "gpu_card_site"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chapter", default="01-single-gpu")
    parser.add_argument("--steps", type=int, default=30, help="steps measured, after as many warm-up steps")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes of each kind, alternated")
    parser.add_argument("--nproc", type=int, default=1, help="processes of the chapter's torchrun job")
    parser.add_argument("--json-out", help="also write the result to this file")
    parser.add_argument("--log-dir", help="keep every process's output here")
    parser.add_argument("--bare-loop", metavar="OPTIONS_JSON", help=argparse.SUPPRESS)
    parser.add_argument("script_args", nargs="*", help="arguments for the chapter's script, after --")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1 or args.nproc < 1:
        raise SystemExit("error: --steps, --repeats and --nproc must be at least 1")
    if args.bare_loop:
        print(json.dumps({"step_seconds": bare_step_seconds(json.loads(args.bare_loop), args.steps, args.steps)}))
        return

    options = vars(load_chapter_parser(args.chapter).parse_args(args.script_args))
    # NOTE: like with like: the bare loop computes in bf16 as the chapter does, under autocast or FSDP's policy.
    fsdp = "MixedPrecisionPolicy(" in (REPO_ROOT / args.chapter / "train_llm.py").read_text()
    options["precision"] = "fsdp" if fsdp else "autocast"
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="benchmark-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    times = {"bare": [], "chapter": []}
    order = []
    for repeat in range(1, args.repeats + 1):
        for kind in ["bare", "chapter"]:
            log_file = log_dir / f"{args.chapter}-{kind}-{repeat}.log"
            if kind == "bare":
                seconds = run_bare_loop(options, args.steps, log_file)
            else:
                seconds = run_chapter(args.chapter, args.script_args, options, args.steps, args.nproc, log_file)
            times[kind].append(seconds * 1e3)
            order.append(kind)
    bare_ms, chapter_ms = statistics.median(times["bare"]), statistics.median(times["chapter"])
    result = {
        "chapter": args.chapter,
        "steps": args.steps,
        "repeats": args.repeats,
        "order": order,
        "bare_step_ms": times["bare"],
        "chapter_step_ms": times["chapter"],
        "bare_median_ms": bare_ms,
        "chapter_median_ms": chapter_ms,
        "ratio": chapter_ms / bare_ms,
        "overhead_percent": (chapter_ms / bare_ms - 1) * 100,
    }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def load_chapter_parser(chapter):
    """The chapter's own argument parser, so that the bare loop uses exactly the options the chapter will."""
    sys.path.insert(0, str(REPO_ROOT / chapter))
    import train_llm  # noqa: E402  (the chapter's script, imported for its argument parser; nothing is timed here)

    return train_llm.get_parser()


def run_bare_loop(options, steps, log_file):
    """The bare loop's step time, in a fresh process that imports only torch and transformers."""
    command = [sys.executable, __file__, "--steps", str(steps), "--bare-loop", json.dumps(options)]
    output = run_logged(command, os.environ, log_file)
    return json.loads(output.strip().splitlines()[-1])["step_seconds"]


def run_chapter(chapter, script_args, options, steps, nproc, log_file):
    """The chapter's own step time: from its tokens/s over a log window of `steps` steps, after as many warm-up steps.

    Within a log window the script synchronizes only at its end, as the bare loop does. The process ends inside the
    step after that window (dev/gpu_card_site), before it would save a checkpoint.
    """
    launcher = [sys.executable]
    if chapter != "01-single-gpu":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    env = {**os.environ, "CARD_STOP_AFTER_STEP": str(2 * steps + 1),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(CARD_SITE), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as save_dir:
        command = [*launcher, str(REPO_ROOT / chapter / "train_llm.py"), *script_args,
                   "--max-steps", str(2 * steps + 1), "--log-freq", str(steps), "--ckpt-freq", str(10 ** 9),
                   "--save-dir", save_dir, "-e", "benchmark", "--wandb-mode", "disabled"]
        run_logged(command, env, log_file)
        records = [json.loads(line) for line in (Path(save_dir) / "benchmark" / "metrics.jsonl").read_text().splitlines()]
    last_window = next(record for record in records if record["step"] == 2 * steps)
    tokens_per_step = options["batch_size"] * options["grad_accum"] * options["seq_length"] * nproc
    return tokens_per_step / last_window["tokens_per_second"]


def run_logged(command, env, log_file):
    """Run a command with its output in log_file; its stdout, or a one-line error if it fails."""
    with open(log_file, "w") as log:
        result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        log.write(result.stdout)
    if result.returncode != 0:
        lines = [line for line in Path(log_file).read_text().splitlines() if line.strip()]
        raise SystemExit(f"error: {' '.join(command[:4])} ... failed with exit status {result.returncode}: "
                         f"{lines[-1] if lines else 'no output'} (see {log_file})")
    return result.stdout


def bare_step_seconds(options, warmup_steps, steps):
    """The least a training step can cost: forward, backward and AdamW on one fixed batch, nothing else."""
    import torch
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if options["dtype"] == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, options["dtype"])
    config = AutoConfig.from_pretrained(options["model_name"])
    with device:
        # NOTE: the chapters' attention: SDPA registered without transformers' host-syncing mask (chapter 05 also
        # offers eager and flash attention under --attn-implementation).
        AttentionInterface.register("causal_sdpa", AttentionInterface()["sdpa"])
        attention = options.get("attn_implementation", "sdpa")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="causal_sdpa" if attention == "sdpa"
                                                 else attention, dtype=torch.float32)
    if options["precision"] == "fsdp":
        shard_like_the_chapter(model, dtype, device)
    print(f"bare loop: {dtype} via {options['precision']}", file=sys.stderr)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    input_ids = torch.randint(0, config.vocab_size, (options["batch_size"], options["seq_length"]), device=device)
    for step in range(warmup_steps + steps):
        if step == warmup_steps:
            synchronize(device)
            started = time.perf_counter()
        for _ in range(options["grad_accum"]):
            autocast = options["precision"] == "autocast" and dtype != torch.float32
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss / options["grad_accum"]
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    synchronize(device)
    return (time.perf_counter() - started) / steps


def shard_like_the_chapter(model, dtype, device):
    """Chapter 04's fully_shard() groups and MixedPrecisionPolicy (bf16 copies of the weights for compute, fp32
    gradient reduction), on a process group of one: what FSDP's precision costs is then in both loops."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    layers = model.model.layers
    for index, layer in enumerate(layers):
        fully_shard(layer, mp_policy=policy, reshard_after_forward=index < len(layers) - 1)
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)


def synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
