#!/bin/bash
# A Kubernetes pod's first process (k8s-job.yaml, k8s-jobset.yaml): one torchrun for this pod's node, and an exit
# code that tells the Job controller what happened:
#   0   the run is done: the checkpoint of step MAX_STEPS exists
#   75  stopped and saved, not done (a preemption's SIGTERM here, or another pod's, which every rank agrees on);
#       the manifests' podFailurePolicy replaces such pods without counting a failure, and they resume
#   else  a failure (torchrun's own code), counted against the Job's backoffLimit
# Usage, as the manifests run it (arguments go to train_llm.py; put --max-steps, -e and --save-dir from the
# variables below, so this script can find the final checkpoint):
#   k8s-entrypoint.sh --max-steps "$MAX_STEPS" -e "$EXPERIMENT" --save-dir "$SAVE_DIR" [train_llm.py args...]
# Environment (set by the manifest; JOB_COMPLETION_INDEX by the Job controller):
#   NNODES, NPROC_PER_NODE   pods, and processes per pod (one per GPU)
#   RDZV_HOST, RDZV_PORT     pod 0's DNS name and the rendezvous port; pod 0 hosts the rendezvous store
#   RDZV_ID                  the same on every pod of one job (the manifests use the Job's uid)
#   MAX_STEPS, EXPERIMENT, SAVE_DIR   as passed to train_llm.py
#   TRAIN_SCRIPT             default 03-job-launchers/train_llm.py; MAX_RESTARTS (default 3), SHUTDOWN_TIMEOUT
#                            (default 240: the seconds a preempted worker gets to finish its step and save)
set -uo pipefail
: "${NNODES:?}" "${NPROC_PER_NODE:?}" "${RDZV_HOST:?}" "${RDZV_PORT:?}" "${RDZV_ID:?}" "${JOB_COMPLETION_INDEX:?}"
: "${MAX_STEPS:?}" "${EXPERIMENT:?}" "${SAVE_DIR:?}"
FINAL_CHECKPOINT=$SAVE_DIR/$EXPERIMENT/checkpoint-$(printf %08d "$MAX_STEPS")

if [ -d "$FINAL_CHECKPOINT" ]; then
    echo "done already: $FINAL_CHECKPOINT exists"
    exit 0
fi
# torchrun's elastic restarts with torch 2.13 need the workers' own store (03-job-launchers/README.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# A preemption or eviction sends SIGTERM to this process only: pass it to the workers, torchrun's children, which
# agree with every other pod's ranks on a step, save it and exit 0. Not to torchrun: a signalled torchrun skips its
# exit barrier, and the other pods' torchrun would wait 300 s for it. No workers yet: torchrun. (No pkill: images
# often lack procps.)
STOPPED=0 TORCHRUN_PID=
stop_workers() {
    local workers
    workers=$(cat /proc/"$TORCHRUN_PID"/task/*/children 2>/dev/null)
    # shellcheck disable=SC2086
    kill -TERM ${workers:-$TORCHRUN_PID} 2>/dev/null || true
}
trap 'STOPPED=1; echo "SIGTERM: checkpoint and exit"; stop_workers' TERM
# Pod 0 hosts the c10d rendezvous store (is_host); the rendezvous hands out the node ranks.
torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-conf "is_host=$([ "$JOB_COMPLETION_INDEX" = 0 ] && echo 1 || echo 0)" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    --shutdown-timeout "${SHUTDOWN_TIMEOUT:-240}" \
    "${TRAIN_SCRIPT:-03-job-launchers/train_llm.py}" "$@" &
TORCHRUN_PID=$!
status=0
wait "$TORCHRUN_PID" || status=$?
if [ "$STOPPED" = 1 ]; then
    status=0
    wait "$TORCHRUN_PID" || status=$?
fi

if [ -d "$FINAL_CHECKPOINT" ]; then
    exit 0
elif [ "$STOPPED" = 1 ] || [ "$status" = 0 ]; then
    echo "stopped and saved at step $(ls "$SAVE_DIR/$EXPERIMENT" | sed -n 's/^checkpoint-0*//p' | sort -n | tail -1)" \
         "of $MAX_STEPS: exit 75, to be resumed"
    exit 75
fi
exit "$status"
