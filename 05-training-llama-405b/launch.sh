#!/bin/bash
# Start chapter 05's train_llm.py on every host of a hosts file, with the environment a 405B run needs.
# The launching itself (ssh into each host, torchrun inside a detached tmux session, c10d rendezvous on the
# first host) is chapter 03's launch-ssh.sh; this script only sets the environment and the training script.
#
# Usage (from the repository checkout, which must be at the same path on every host, e.g. a shared file system):
#   05-training-llama-405b/launch.sh HOSTS_FILE [train_llm.py args...]
#   05-training-llama-405b/launch.sh my-hosts -m /shared/models/Llama-3.1-405B -d /shared/data/alpaca -e llama-405b \
#       --seq-length 4096 --batch-size 1 --activation-checkpointing --cpu-offload --compile
#   tail -f logs/train-llama-405b-0.log               # rank 0's host
#   03-job-launchers/stop-ssh.sh my-hosts -e llama-405b
# HOSTS_FILE: one host per line with its GPU count, "gpu-node-01 slots=8" (see 03-job-launchers/hosts).
# Every variable set below keeps a value you set yourself and reaches every host. launch-ssh.sh's own knobs
# (NPROC_PER_NODE, RDZV_PORT, MAX_RESTARTS, SSH, TORCHRUN, FORWARD_ENV) work as they do there.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 HOSTS_FILE [train_llm.py args...]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)

# FSDP allocates and frees a whole gathered layer (6.4 GB in bf16 at 405B) twice a step per layer. Expandable
# segments let the CUDA caching allocator grow one mapping instead of keeping blocks of every size: without it, a
# fragmented 80 GB GPU runs out of memory with gigabytes free. (PYTORCH_CUDA_ALLOC_CONF, the older name, is kept.)
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
# CPU threads per process. torchrun sets 1 when this is unset, and with --cpu-offload AdamW then steps a 6B-parameter
# shard on one core, many times slower. 16 suits 8 processes on a host of 128 or more cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-16}
# Nothing is downloaded inside the job: every other rank would wait at a barrier while rank 0 fetches 800 GB, and
# time out after 10 minutes. download.sh puts the model in a shared folder beforehand; pass -m that folder, and -d a
# local data set too (see README.md). HF_HUB_OFFLINE=0 allows downloads again.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# The tokenized data set is cached in HF_HOME: on a shared file system, rank 0 tokenizes and everyone reads it.
# launch-ssh.sh sends every HF_*, NCCL_* and WANDB_* variable (HF_HUB_OFFLINE, HF_HOME, NCCL_IB_HCA, ...) and
# OMP_NUM_THREADS itself; the allocator setting is added to its list.
export FORWARD_ENV="${FORWARD_ENV:-} PYTORCH_ALLOC_CONF"

TRAIN_SCRIPT=$HERE/train_llm.py exec "$HERE/../03-job-launchers/launch-ssh.sh" "$@"
