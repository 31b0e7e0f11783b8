"""Every rank downloads and tokenizes the dataset at once.

Each rank checks the cache, finds it empty and does the whole job itself: N
ranks make N downloads (a hub answers with 429s, a shared filesystem crawls) and
N tokenizations that fight for the node's CPU cores, before the first step.
The download here is simulated (a sleep) so that it runs offline.

    torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/everyone_downloads.py
  -> one "cache miss" line per rank; py-spy shows every rank in prepare()
    torchrun --standalone --nproc-per-node 2 diagnosing-errors/broken/everyone_downloads.py --fix
  -> one "cache miss" line per node; the other ranks wait at the barrier, then read the cache

The cache lives in outputs/cache/<torchrun run id>, so each run starts cold.
"""
import argparse
import os
import random
import time

import torch
import torch.distributed as dist


def download(seed=0, n_words=300_000):
    time.sleep(1.0)  # the network
    rng = random.Random(seed)
    words = ["".join(rng.choices("abcdefgh", k=rng.randint(2, 6))) for _ in range(5000)]
    return " ".join(rng.choices(words, k=n_words))


def tokenize(text):
    vocab = {}
    return torch.tensor([vocab.setdefault(w, len(vocab)) for w in text.split()])


def prepare(path, rank):
    t0 = time.time()
    ids = tokenize(download())
    tmp = f"{path}.tmp{rank}"
    torch.save(ids, tmp)
    os.replace(tmp, path)  # NOTE: atomic: a reader never sees a half-written file
    print(f"rank {rank}: cache miss, downloaded and tokenized in {time.time() - t0:.1f} s", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fix", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    cache = os.path.join("outputs", "cache", os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, "tokens.pt")

    t0 = time.time()
    if args.fix:
        # NOTE: local rank 0 for a node-local cache; use global rank 0 if the cache is on a shared filesystem.
        if local_rank == 0 and not os.path.exists(path):
            prepare(path, rank)
        dist.barrier()
    elif not os.path.exists(path):
        prepare(path, rank)
    ids = torch.load(path, map_location="cpu", weights_only=True)
    print(f"rank {rank}: {len(ids)} tokens ready after {time.time() - t0:.1f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
