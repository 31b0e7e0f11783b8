#!/bin/bash
# The checks of this chapter that need CUDA GPUs (not run by pytest: CI has no GPU; not yet run: no GPU machine was
# available when the chapter was written). From the repository root, on a machine with 2, 4 or 8 GPUs:
#   bash 09-context-parallel/gpu_check.sh [OUTPUT_DIR]
#   attention   09-context-parallel/cp_attention_check.py on every GPU, NCCL: ring and all-to-all,
#               load balancing on and off, each rank's output and q/k/v gradients against full causal
#               attention (within 2e-5, fp32), and the whole model module by module (within 1e-5)
#   ring, all-to-all
#               the tiny model trained 20 steps in bf16 on 1,024-token sequences (its longest) split over every GPU (--cp N), with
#               each form: the same losses as --cp 1 (plain FSDP, SDPA) within bf16 noise, and less GPU memory
# Prints one line per case and a summary; logs and metrics stay in OUTPUT_DIR (default: gpu-check-09).
set -uo pipefail

OUT_DIR=${1:-gpu-check-09}
NPROC=$(python -c "import torch; print(torch.cuda.device_count())")
[ "$NPROC" -ge 2 ] || { echo "context parallelism needs at least 2 CUDA GPUs here, found $NPROC" >&2; exit 1; }
# NOTE: all-to-all needs --cp to divide the tiny model's 4 key/value heads: with 8 GPUs it runs as dp 2 x cp 4.
CP=$(( NPROC > 4 ? 4 : NPROC ))
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTORCH_ALLOC_CONF=expandable_segments:True
ARGS=(--max-steps 20 --seq-length 1024 --batch-size 1 --log-freq 1 --ckpt-freq 1000 --warmup-steps 5 --num-workers 1
      --save-dir "$OUT_DIR/outputs")
FAILED=0

report() {  # report NAME OK DETAILS
    if [ "$2" = 0 ]; then echo "PASS $1: $3"; else echo "FAIL $1: $3 (see $OUT_DIR/$1.log)"; FAILED=1; fi
}
peak_gb() { python -c "import json,sys; print(max(json.loads(l)['memory_allocated_gb'] for l in open(sys.argv[1])))" \
                "$OUT_DIR/outputs/$1/metrics.jsonl"; }
close_to() {  # close_to REFERENCE NAME TOLERANCE: the largest loss difference, and whether it is within TOLERANCE
    python - "$OUT_DIR/outputs/$1/metrics.jsonl" "$OUT_DIR/outputs/$2/metrics.jsonl" "$3" <<'EOF'
import json, sys
a, b = ([json.loads(line)["loss"] for line in open(path)] for path in sys.argv[1:3])
difference = max(abs(x - y) for x, y in zip(a, b))
print(f"largest loss difference from --cp 1 {difference:.2e} over {len(b)} steps")
sys.exit(0 if len(a) == len(b) == 20 and difference <= float(sys.argv[3]) else 1)
EOF
}

timeout 600 torchrun --standalone --nproc-per-node "$NPROC" 09-context-parallel/cp_attention_check.py > "$OUT_DIR/attention.log" 2>&1
report attention $? "$(grep -E '^(ok|error):' "$OUT_DIR/attention.log" | head -1)"

# NOTE: --cp CP on NPROC GPUs trains NPROC / CP sequences a step (one per data-parallel group); the reference without
# context parallelism runs on NPROC / CP GPUs, one sequence each, so that both see the same global batch.
timeout 900 torchrun --standalone --nproc-per-node $(( NPROC / CP )) 09-context-parallel/train_llm.py "${ARGS[@]}" \
    -e cp1 > "$OUT_DIR/cp1.log" 2>&1
report cp1 $? "plain FSDP on $(( NPROC / CP )) GPUs; peak GPU memory $(peak_gb cp1 2>/dev/null) GB"
for form in ring all-to-all; do
    if timeout 900 torchrun --standalone --nproc-per-node "$NPROC" 09-context-parallel/train_llm.py "${ARGS[@]}" \
            --cp "$CP" --cp-attention "$form" -e "$form" > "$OUT_DIR/$form.log" 2>&1; then
        details=$(close_to cp1 "$form" 0.02); ok=$?
    else
        details="the run failed: $(grep '^error:' "$OUT_DIR/$form.log" | head -1)"; ok=1
    fi
    report "$form" $ok "--cp $CP; $details; peak GPU memory $(peak_gb "$form" 2>/dev/null) GB"
done

[ "$FAILED" = 0 ] && echo "all checks passed" || echo "some checks failed"
exit $FAILED
