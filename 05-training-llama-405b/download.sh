#!/bin/bash
# Download a model from the Hugging Face hub into a folder every node can read, before the job starts: only what
# training needs (config, tokenizer, *.safetensors weights), the same files train_llm.py fetches for a hub name.
# Llama 3.1 405B's repository holds its weights twice; original/ (Meta's own format, another 800 GB) is skipped, and
# so are Mistral's consolidated*.safetensors (the weights again, under Mistral's names), which train_llm.py ignores.
#
# Usage:
#   05-training-llama-405b/download.sh MODEL [PARENT_DIR]       # into PARENT_DIR/<name>, default /shared/models
#   hf auth login                                             # first, for a gated model such as Llama
#   05-training-llama-405b/download.sh meta-llama/Llama-3.1-405B /shared/models
#   05-training-llama-405b/launch.sh hosts -m /shared/models/Llama-3.1-405B ...
# Downloading 800 GB takes hours on a 1 Gb/s link and minutes on 10 GB/s. Run it again if it stops: files that
# are complete are not downloaded twice.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 MODEL [PARENT_DIR]" >&2; exit 2; }
MODEL=$1
DEST=${2:-/shared/models}/${MODEL##*/}

hf download "$MODEL" --local-dir "$DEST" \
    --include "*.json" --include "*.safetensors" --include "tokenizer*" \
    --exclude "original/*" --exclude "consolidated*.safetensors"
echo "downloaded $MODEL into $DEST; pass -m $DEST to train_llm.py" >&2
