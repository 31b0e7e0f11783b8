#!/bin/bash
# A Kubernetes pod's first process (k8s-job.yaml, k8s-jobset.yaml): one torchrun for this pod's node, and an exit
# code that tells the Job controller what happened:
#   0   the run is done: the checkpoint of step MAX_STEPS exists
#   75  stopped and saved, not done (a preemption's SIGTERM here, or another pod's, which every rank agrees on);
#       the manifests' podFailurePolicy replaces such pods without counting a failure, and they resume
#   1   torchrun exited 0 without saving a new step and without the final checkpoint (--max-steps other than
#       MAX_STEPS, --num-epochs): not retried forever
#   else  a failure (torchrun's own code), counted against the Job's backoffLimit
# Usage, as the manifests run it (arguments go to train_llm.py; put --max-steps, -e and --save-dir from the
# variables below, so this script can find the final checkpoint):
#   k8s-entrypoint.sh --max-steps "$MAX_STEPS" -e "$EXPERIMENT" --save-dir "$SAVE_DIR" [train_llm.py args...]
# Environment (set by the manifest; JOB_COMPLETION_INDEX by the Job controller):
#   NNODES, NPROC_PER_NODE   pods, and processes per pod (one per GPU)
#   RDZV_HOST, RDZV_PORT     pod 0's DNS name and the rendezvous port; pod 0 hosts the rendezvous store
#   RDZV_ID                  the same on every pod of one job (the manifests use the Job's uid)
#   MAX_STEPS, EXPERIMENT, SAVE_DIR   as passed to train_llm.py
#   TRAIN_SCRIPT             default 03-job-launchers/train_llm.py; MAX_RESTARTS (default 3)
#   RDZV_TIMEOUT             seconds a pod waits for the others at the rendezvous (default 1800: a replaced pod
#                            can stay Pending for minutes)
set -uo pipefail
: "${NNODES:?}" "${NPROC_PER_NODE:?}" "${RDZV_HOST:?}" "${RDZV_PORT:?}" "${RDZV_ID:?}" "${JOB_COMPLETION_INDEX:?}"
: "${MAX_STEPS:?}" "${EXPERIMENT:?}" "${SAVE_DIR:?}"
FINAL_CHECKPOINT=$SAVE_DIR/$EXPERIMENT/checkpoint-$(printf %08d "$MAX_STEPS")
latest_checkpoint() { ls -d "$SAVE_DIR/$EXPERIMENT"/checkpoint-* 2>/dev/null | sort | tail -1; }

if [ -d "$FINAL_CHECKPOINT" ]; then
    echo "done already: $FINAL_CHECKPOINT exists"
    exit 0
fi
# torchrun's elastic restarts with torch 2.13 need the workers' own store (03-job-launchers/README.md).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}

# A preemption or eviction sends SIGTERM to this process only: pass it to the workers, torchrun's children, which
# agree with every other pod's ranks on a step, save it and exit 0. Not to torchrun: a signalled torchrun skips its
# exit barrier, where the other pods' torchrun would wait 300 s. Found in /proc (images often lack pkill); none
# yet (torchrun is in its rendezvous): torchrun. Once: a worker that already saved and is exiting would die of a
# second one, a failure that torchrun answers by restarting every pod's workers.
STOPPED=0 TORCHRUN_PID=
stop_workers() {
    local stat line ppid workers=
    for stat in /proc/[0-9]*/stat; do
        read -r line < "$stat" 2>/dev/null || continue
        ppid=${line##*) }          # "pid (name) state ppid ...": the name may hold spaces and parentheses
        ppid=${ppid#* }
        [ "${ppid%% *}" = "$TORCHRUN_PID" ] && workers="$workers ${line%% *}"
    done
    # shellcheck disable=SC2086
    kill -TERM ${workers:-$TORCHRUN_PID} 2>/dev/null || true
}
trap 'STOPPED=1; echo "SIGTERM: checkpoint and exit"; [ -z "$TORCHRUN_PID" ] || stop_workers' TERM
STARTED_FROM=$(latest_checkpoint)
# Pod 0 hosts the c10d rendezvous store (is_host); the others wait for it up to RDZV_TIMEOUT seconds.
torchrun \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" \
    --rdzv-id "$RDZV_ID" \
    --rdzv-conf "is_host=$([ "$JOB_COMPLETION_INDEX" = 0 ] && echo 1 || echo 0),read_timeout=${RDZV_TIMEOUT:-1800},join_timeout=${RDZV_TIMEOUT:-1800}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    "${TRAIN_SCRIPT:-03-job-launchers/train_llm.py}" "$@" &
TORCHRUN_PID=$!
[ "$STOPPED" = 0 ] || stop_workers
status=0
wait "$TORCHRUN_PID" || status=$?
[ "$STOPPED" = 0 ] || { status=0; wait "$TORCHRUN_PID" || status=$?; }

if [ -d "$FINAL_CHECKPOINT" ]; then
    exit 0
elif [ "$STOPPED" = 1 ] || { [ "$status" = 0 ] && [ "$(latest_checkpoint)" != "$STARTED_FROM" ]; }; then
    echo "stopped and saved $(latest_checkpoint), not $FINAL_CHECKPOINT: exit 75, to be resumed"
    exit 75
elif [ "$status" = 0 ]; then
    echo "error: torchrun exited 0 without a new checkpoint or $FINAL_CHECKPOINT; pass --max-steps \$MAX_STEPS" >&2
    exit 1
fi
exit "$status"
