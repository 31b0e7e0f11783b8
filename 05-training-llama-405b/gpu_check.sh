#!/bin/bash
# The checks of this chapter that need a CUDA GPU, on the tiny model, in about 5 minutes on one GPU (not run by
# pytest: CI has no GPU; not yet run: no GPU machine was available when the chapter was written). From the
# repository root, on a machine with at least one GPU:
#   bash 05-training-llama-405b/gpu_check.sh [OUTPUT_DIR]
# A first run trains the tiny model 20 steps from the seed and is converted into a Hugging Face folder. Every case
# then fine-tunes from that folder for 20 steps in bf16 on all local GPUs, and is compared with the plain fine-tune.
# (Starting from the same pretrained weights matters: with --cpu-offload the shards live on the CPU, and the seeded
# initialization draws other numbers there than on the GPU.)
#   pretrained     the folder's weights loaded into the shards: the first loss is far below the seeded run's
#   cpu-offload    parameters, gradients and AdamW state in CPU memory, the optimizer step on the CPU, gloo for the
#                  CPU tensors: the same losses (within bf16 noise), less GPU memory
#   405b-features  activation checkpointing, torch.compile (inductor with Triton) and CPU offload together, as in the
#                  405B command: the same losses
#   flash          --attn-implementation flash_attention_2 if flash-attn is installed, else its one-line error
#   chapter-04     chapter 04 with --cpu-offload (NCCL for GPU tensors, gloo for the offloaded CPU ones)
#   one-gpu-per-task  local rank 1 in a process that sees one GPU (Slurm's --gpus-per-task=1) trains on cuda:0
# Prints one line per case and a summary; logs and metrics stay in OUTPUT_DIR (default: gpu-check).
set -uo pipefail

OUT_DIR=${1:-gpu-check}
NPROC=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$NPROC" -ge 1 ] || { echo "no CUDA GPU here" >&2; exit 1; }
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
ARGS=(--max-steps 20 --seq-length 256 --batch-size 8 --log-freq 1 --ckpt-freq 1000 --warmup-steps 5 --num-workers 1
      --save-dir "$OUT_DIR/outputs")
CH05=05-training-llama-405b
PRETRAINED=$OUT_DIR/pretrained-hf
FAILED=0

train() {  # train CHAPTER_DIR NAME [args...]: 20 steps on every local GPU, output in OUT_DIR/NAME.log
    local chapter=$1 name=$2; shift 2
    timeout 300 torchrun --standalone --nproc-per-node "$NPROC" "$chapter/train_llm.py" "${ARGS[@]}" -e "$name" "$@" \
        > "$OUT_DIR/$name.log" 2>&1
}
losses() { python -c "import json,sys; print(' '.join(f\"{json.loads(l)['loss']:.4f}\" for l in open(sys.argv[1])))" \
               "$OUT_DIR/outputs/$1/metrics.jsonl"; }
peak_gb() { python -c "import json,sys; print(max(json.loads(l)['memory_allocated_gb'] for l in open(sys.argv[1])))" \
                "$OUT_DIR/outputs/$1/metrics.jsonl"; }
close_to_plain() {  # the largest loss difference from the plain fine-tune, and whether it is under the tolerance
    python - "$OUT_DIR/outputs/plain/metrics.jsonl" "$OUT_DIR/outputs/$1/metrics.jsonl" "$2" <<'EOF'
import json, sys
a, b = ([json.loads(line)["loss"] for line in open(path)] for path in sys.argv[1:3])
difference = max(abs(x - y) for x, y in zip(a, b))
print(f"largest loss difference from plain {difference:.2e} over {len(b)} steps")
sys.exit(0 if len(a) == len(b) and difference <= float(sys.argv[3]) else 1)
EOF
}
report() {  # report NAME OK DETAILS
    if [ "$2" = 0 ]; then echo "PASS $1: $3"; else echo "FAIL $1: $3 (see $OUT_DIR/$1.log)"; FAILED=1; fi
}
check() {  # check NAME TOLERANCE [args...]: fine-tune with the args, compare with the plain fine-tune
    local name=$1 tolerance=$2 details ok; shift 2
    if train $CH05 "$name" -m "$PRETRAINED" "$@"; then
        details=$(close_to_plain "$name" "$tolerance"); ok=$?
    else
        details="the run failed"; ok=1
    fi
    report "$name" $ok "$details; peak GPU memory $(peak_gb "$name" 2>/dev/null) GB (plain: $(peak_gb plain) GB)"
}

if ! { train $CH05 seeded && python 04-fully-sharded-data-parallel/convert_to_hf.py "$OUT_DIR/outputs/seeded" \
        -o "$PRETRAINED" > "$OUT_DIR/convert.log" 2>&1; }; then
    echo "FAIL the seeded run or its conversion (see $OUT_DIR/seeded.log and convert.log)"; exit 1
fi
train $CH05 plain -m "$PRETRAINED" && grep -q "loaded the pretrained weights" "$OUT_DIR/plain.log"
report pretrained $? "first losses from the seed $(losses seeded | cut -d' ' -f1-3), from the pretrained folder \
$(losses plain 2>/dev/null | cut -d' ' -f1-3); peak GPU memory $(peak_gb plain 2>/dev/null) GB"
[ $FAILED = 0 ] || exit 1

check cpu-offload 2e-2 --cpu-offload
check 405b-features 5e-2 --activation-checkpointing --compile --cpu-offload
if python -c "import flash_attn" 2>/dev/null; then
    check flash 5e-2 --attn-implementation flash_attention_2
else
    echo "SKIP flash: flash-attn is not installed (pip install flash-attn --no-build-isolation)"
    train $CH05 flash-missing --attn-implementation flash_attention_2
    grep -q "error: --attn-implementation flash_attention_2 needs" "$OUT_DIR/flash-missing.log"
    report flash-missing $? "without flash-attn the flag gets a one-line error"
fi

train 04-fully-sharded-data-parallel chapter-04 --cpu-offload --max-steps 2
report chapter-04 $? "chapter 04 trains with --cpu-offload"

# One visible GPU per process, as under Slurm's --gpus-per-task=1: local rank 1, but only GPU 0 to see.
CUDA_VISIBLE_DEVICES=0 RANK=0 LOCAL_RANK=1 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 timeout 300 \
    python $CH05/train_llm.py "${ARGS[@]}" -e one-gpu-per-task --max-steps 2 > "$OUT_DIR/one-gpu-per-task.log" 2>&1 \
    && grep -q "(local rank 1), device: cuda:0" "$OUT_DIR/one-gpu-per-task.log"
report one-gpu-per-task $? "local rank 1 with one visible GPU trains on cuda:0"

if [ $FAILED = 0 ]; then echo "all GPU checks passed"; else echo "some GPU checks FAILED"; fi
exit $FAILED
