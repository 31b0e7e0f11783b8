#!/bin/bash
# Launch train_llm.py on plain machines (no Slurm, no MPI): ssh into every host of a hosts file and
# start torchrun there inside a detached tmux session, so training survives your laptop logging off.
# torchrun's c10d rendezvous, hosted by the first host, groups the nodes and hands out the ranks.
#
# Usage (run from the repo checkout; the same path must exist on every host, e.g. a shared FS):
#   03-job-launchers/launch-ssh.sh HOSTS_FILE [train_llm.py args...]
#   03-job-launchers/launch-ssh.sh my-hosts -e my-run --max-steps 1000
#   tmux attach -t train-my-run-0        # on host 0: watch it (detach again with Ctrl-b d)
#   03-job-launchers/stop-ssh.sh my-hosts -e my-run
# HOSTS_FILE: one host per line (first word; "slots=N" sets that host's process count, as in the
# mpirun hosts file next to this script); # starts a comment. Host i runs tmux session
# train-<experiment>-<i> and appends its output to logs/train-<experiment>-<i>.log.
# Environment knobs:
#   NPROC_PER_NODE  processes per host (default: slots= of that line, else 1)
#   RDZV_HOST       rendezvous address (default: first host), RDZV_PORT (default 29500)
#   MAX_RESTARTS    torchrun restarts after a failure (default 3)
#   SSH             ssh command (default "ssh"; e.g. "ssh -p 2222", or a test shim). A host named
#                   localhost is started without ssh, so one machine needs no ssh server.
#   TORCHRUN        torchrun to run remotely (default: the one on your PATH, as an absolute path)
#   FORWARD_ENV     names of extra variables to copy to the hosts (ssh does not pass your environment)
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 HOSTS_FILE [train_llm.py args...]" >&2; exit 2; }
HOSTS_FILE=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
SSH=${SSH:-ssh}
# Run a shell command on a host: over ssh, or right here for "localhost".
on_host() {
    # shellcheck disable=SC2086
    if [ "$1" = localhost ]; then bash -c "$2"; else $SSH "$1" "$2"; fi
}
WORKDIR=$PWD
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$HERE/train_llm.py}
TORCHRUN=${TORCHRUN:-$(command -v torchrun)}
# FSDP gathers and frees a layer of weights at a time, and MoE buffers change size every layer: expandable segments
# let the CUDA caching allocator grow one mapping instead of keeping blocks of every size (no effect on the CPU).
# PYTORCH_ALLOC_CONF is the name torch reads now (it warns at the older PYTORCH_CUDA_ALLOC_CONF, kept if you set it).
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
LOG_DIR=$WORKDIR/logs

# Hosts and their slots, comments and blank lines dropped.
mapfile -t LINES < <(sed -e 's/#.*//' "$HOSTS_FILE" | awk 'NF')
[ ${#LINES[@]} -gt 0 ] || { echo "no hosts in $HOSTS_FILE" >&2; exit 1; }
NNODES=${#LINES[@]}
RDZV_HOST=${RDZV_HOST:-$(awk '{print $1}' <<<"${LINES[0]}")}
RDZV_PORT=${RDZV_PORT:-29500}

# The experiment name (-e/--experiment-name) names the tmux sessions (tmux forbids "." and ":";
# we keep only letters, digits, "_" and "-", which also need no quoting below).
EXP=run
for ((i = 1; i <= $#; i++)); do
    case ${!i} in
        -e | --experiment-name) j=$((i + 1)); EXP=${!j:-run} ;;
        --experiment-name=*) EXP=${!i#*=} ;;
    esac
done
EXP=${EXP//[^A-Za-z0-9_-]/_}
# A fresh rendezvous id per launch, shared by all hosts: a stale run's state is never joined.
RDZV_ID=${RDZV_ID:-$EXP-$(date +%Y%m%d%H%M%S)}

# Variables to copy to the remote side, if they are set here: these, FORWARD_ENV's, and every HF_*, NCCL_* and
# WANDB_* variable (the Hugging Face cache and token, NCCL's and wandb's settings). mpirun.sh forwards the same.
ENV_VARS="PYTHONPATH OMP_NUM_THREADS PYTORCH_ALLOC_CONF CUDA_VISIBLE_DEVICES GLOO_SOCKET_IFNAME ${FORWARD_ENV:-}
          $(compgen -e | grep -E '^(HF|NCCL|WANDB)_' || true)"
ENV_ASSIGN=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)   # reliable elastic restarts (see job.sbatch)
for v in $ENV_VARS; do
    if [ -n "${!v+set}" ] && [[ " ${ENV_ASSIGN[*]%%=*} " != *" $v "* ]]; then ENV_ASSIGN+=("$v=${!v}"); fi
done

for i in "${!LINES[@]}"; do
    read -r host rest <<<"${LINES[$i]}"
    slots=$(sed -n 's/.*slots=\([0-9]*\).*/\1/p' <<<"$rest")
    nproc=${NPROC_PER_NODE:-${slots:-1}}
    session=train-$EXP-$i
    # torchrun as in job.sbatch (see the flags there). --local-addr: how the other hosts reach this
    # one (its name in the hosts file); by default torchrun advertises socket.getfqdn(), which is
    # "localhost" on some /etc/hosts set-ups.
    cmd=(env "${ENV_ASSIGN[@]}" "$TORCHRUN"
        --nnodes "$NNODES" --nproc-per-node "$nproc"
        --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$RDZV_ID"
        --local-addr "$host"
        --max-restarts "${MAX_RESTARTS:-3}"
        --log-dir "$LOG_DIR/$session"
        "$TRAIN_SCRIPT" "$@")
    # What tmux runs on the host. printf %q quotes every word, so arguments with spaces survive.
    inner="cd $(printf %q "$WORKDIR") && $(printf '%q ' "${cmd[@]}") 2>&1 | tee -a $(printf %q "$LOG_DIR/$session.log")"
    # What ssh runs: refuse to start twice ("=" makes tmux match the name exactly, not as a prefix),
    # then start a detached (-d) session named $session running $inner.
    remote="mkdir -p $(printf %q "$LOG_DIR") &&
        if tmux has-session -t =$session 2>/dev/null; then echo '$host: $session is already running' >&2; exit 1; fi &&
        tmux new-session -d -s $session $(printf %q "$inner")"
    echo "host $i ($host): tmux session $session, $nproc process(es), rendezvous $RDZV_HOST:$RDZV_PORT" >&2
    on_host "$host" "$remote"
done
echo "started $NNODES host(s); logs in $LOG_DIR/train-$EXP-*.log; stop with: $HERE/stop-ssh.sh $HOSTS_FILE -e $EXP" >&2
