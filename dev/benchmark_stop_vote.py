"""What the ranks' agreement to stop costs a host per step: a blocking gloo all-reduce in every step (chapters 02-11
until 2026-12) against the vote started in one step and read in the next (vote_to_stop() in chapters 02-11 now).

    torchrun --standalone --nproc-per-node 64 dev/benchmark_stop_vote.py --steps 40 --step-ms 50

Each process plays a training step as a host that has queued its work and waits for its GPU: it sleeps --step-ms,
give or take --jitter (ranks never finish a step together: data, stragglers, the OS), then agrees to stop, both
ways in turn on the same processes. Rank 0 prints, per way, the host time the agreement took per step, over all
ranks and steps but the first few: its median, 90th percentile and maximum, in milliseconds. On a GPU the blocking
way also stops the host from queueing the next step until every host has finished this one.
"""

import argparse
import ast
import datetime
import random
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the host's wait for its GPU per step")
    parser.add_argument("--jitter", type=float, default=0.1, help="each step's time varies by up to this fraction")
    parser.add_argument("--warmup-steps", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    stop_group = dist.new_group(backend="gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    random.seed(rank)
    results = {}
    for way in ["blocking", "a step later"]:
        dist.barrier()
        agreed_to_stop, seconds = (lambda: False), []
        for step in range(args.steps):
            time.sleep(args.step_ms / 1000 * (1 + random.uniform(-args.jitter, args.jitter)))
            started = time.perf_counter()
            if way == "blocking":
                votes = torch.tensor(0)
                dist.all_reduce(votes, group=stop_group)
                stop = votes.item() > 0
            else:
                stop = agreed_to_stop()
                agreed_to_stop = vote_to_stop([], stop_group)
            seconds.append(time.perf_counter() - started)
            assert not stop
        agreed_to_stop()
        gathered = [None] * world_size
        dist.all_gather_object(gathered, seconds[args.warmup_steps:])
        results[way] = sorted(s * 1000 for rank_seconds in gathered for s in rank_seconds)
    if rank == 0:
        print(f"{world_size} processes, {args.steps - args.warmup_steps} steps of {args.step_ms:g} ms "
              f"± {args.jitter:.0%}: the agreement's host time per step, ms")
        print("| way | median | p90 | max |\n| --- | --- | --- | --- |")
        for way, ms in results.items():
            print(f"| {way} | {statistics.median(ms):.3f} | {ms[int(0.9 * len(ms))]:.3f} | {ms[-1]:.3f} |")
    dist.destroy_process_group()


def chapter_function(name, chapter="04-fully-sharded-data-parallel"):
    """A function of a chapter's script, as it is there, without importing the script (and transformers)."""
    path = Path(__file__).resolve().parent.parent / chapter / "train_llm.py"
    (function,) = [node for node in ast.parse(path.read_text()).body
                   if isinstance(node, ast.FunctionDef) and node.name == name]
    namespace = {"torch": torch, "dist": dist}
    exec(compile(ast.Module([function], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


vote_to_stop = chapter_function("vote_to_stop")


if __name__ == "__main__":
    main()
