#!/bin/bash
# This chapter's GPU checks are part of the GPU card (dev/gpu_card.py); this runs the card for chapters 04 and 05
# only, on the local GPUs, in a few minutes. Both chapters train the Llama 3.2 1B-shaped model of data/; chapter 05
# then fine-tunes from a folder holding exactly its seeded weights, plainly (the pretrained loading), with
# --activation-checkpointing, --compile, --cpu-offload, flash attention (or, without flash-attn, its one-line error)
# and the 405B command's features together, each compared with the plain fine-tune; chapter 04 runs with
# --cpu-offload. From the repository root, on a machine with at least one GPU:
#   bash 05-training-llama-405b/gpu_check.sh [OUTPUT_DIR] [more dev/gpu_card.py arguments]
# The card (card.md, card.json) and every run's log go to OUTPUT_DIR (default: gpu-check). The whole card, every
# chapter: python dev/gpu_card.py --out gpu-card
set -euo pipefail

OUT_DIR=${1:-gpu-check}
exec python "$(dirname "$0")/../dev/gpu_card.py" --only 04,05 --out "$OUT_DIR" "${@:2}"
