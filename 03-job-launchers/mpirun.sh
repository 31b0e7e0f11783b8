#!/bin/bash
# Launch train_llm.py with Open MPI's mpirun: one process per slot of the hosts file.
# mpirun only starts the processes (over ssh on other hosts); the training itself still uses
# torch.distributed. Each process finds its rank in OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK,
# and the rendezvous in MASTER_ADDR/MASTER_PORT, which this script sets and forwards with -x,
# with the variables of your shell that training reads (see FORWARDED_ENV below).
#
# Usage (from anywhere): 03-job-launchers/mpirun.sh [HOSTS_FILE] [train_llm.py args...]
#   03-job-launchers/mpirun.sh -e my-run --max-steps 100          # the hosts file next to this script
#   03-job-launchers/mpirun.sh my-hosts -e my-run                 # as launch-ssh.sh takes it
#   NP=16 03-job-launchers/mpirun.sh my-hosts -e my-run
#   MPIRUN_ARGS=--allow-run-as-root 03-job-launchers/mpirun.sh -e ci   # mpirun refuses root otherwise
# HOSTS_FILE is the first argument if that does not start with "-".
# Environment knobs:
#   HOSTFILE     Open MPI hostfile ("host slots=N" lines; default: the hosts file next to this script),
#                used when no HOSTS_FILE argument is given
#   NP           number of processes (default: the sum of the slots in HOSTFILE)
#   MASTER_ADDR  rendezvous host (default: first host of HOSTFILE), MASTER_PORT (default 29500)
#   MPIRUN_ARGS  extra mpirun options, split on spaces (e.g. "--allow-run-as-root --oversubscribe
#                --tag-output")
#   FORWARD_ENV  names of extra variables to forward, as in launch-ssh.sh
#   PYTHON       interpreter (default: the python on your PATH, as an absolute path)
#   TRAIN_ARGS   extra train_llm.py flags, split on spaces, placed before your own arguments
# Other hosts need passwordless ssh from this one, Open MPI installed, and the same paths
# (same checkout and virtual environment, e.g. on a shared file system).
set -euo pipefail

# Unlike in a Slurm batch script, $0 is the real file here: find the repo files next to it.
HERE=$(cd "$(dirname "$0")" && pwd)
HOSTFILE=${HOSTFILE:-$HERE/hosts}
if [ $# -gt 0 ] && [[ $1 != -* ]]; then HOSTFILE=$1; shift; fi
TRAIN_SCRIPT=${TRAIN_SCRIPT:-$HERE/train_llm.py}
# Absolute paths: remote processes start in a directory of the same name, but with a bare PATH.
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
[ -f "$HOSTFILE" ] || { echo "hosts file not found: $HOSTFILE" >&2; exit 1; }

# Hostfile lines without comments and blank lines.
hosts_lines() { sed -e 's/#.*//' "$HOSTFILE" | awk 'NF'; }
# Default number of processes: the sum of slots= (a host without slots= counts once).
if [ -z "${NP:-}" ]; then
    NP=$(hosts_lines | awk '{n=1; for (i=2;i<=NF;i++) if ($i ~ /^slots=/) n=substr($i,7); s+=n} END {print s+0}')
fi
# Rank 0 is placed on the first host (mpirun fills hosts in order), so the store lives there.
export MASTER_ADDR=${MASTER_ADDR:-$(hosts_lines | awk '{print $1; exit}')}
export MASTER_PORT=${MASTER_PORT:-29500}
# mpirun does not set this (torchrun does): one thread per process, so N processes don't fight
# over the cores. Raise it when each process has several cores to itself.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# FSDP gathers and frees a layer of weights at a time, and MoE buffers change size every layer: expandable segments
# let the CUDA caching allocator grow one mapping instead of keeping blocks of every size (no effect on the CPU).
# PYTORCH_ALLOC_CONF is the name torch reads now (it warns at the older PYTORCH_CUDA_ALLOC_CONF, kept if you set it).
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}}
# mpirun gives the remote processes only the variables -x names. Forward those training reads, if set here, as
# launch-ssh.sh does: the Hugging Face cache and token, NCCL's and wandb's settings (every HF_*, NCCL_* and
# WANDB_* variable), the interfaces and GPUs to use, PYTHONPATH, and FORWARD_ENV's names.
FORWARDED_ENV=(MASTER_ADDR MASTER_PORT OMP_NUM_THREADS PYTORCH_ALLOC_CONF PATH)
# shellcheck disable=SC2086
for name in PYTHONPATH CUDA_VISIBLE_DEVICES GLOO_SOCKET_IFNAME ${FORWARD_ENV:-} \
            $(compgen -e | grep -E '^(HF|NCCL|WANDB)_' || true); do
    if [ -n "${!name+set}" ] && [[ " ${FORWARDED_ENV[*]} " != *" $name "* ]]; then FORWARDED_ENV+=("$name"); fi
done
X_FLAGS=()
for name in "${FORWARDED_ENV[@]}"; do X_FLAGS+=(-x "$name"); done
# shellcheck disable=SC2086
set -- ${TRAIN_ARGS:-} "$@"
echo "mpirun: $NP processes from $HOSTFILE, master $MASTER_ADDR:$MASTER_PORT, forwarding ${FORWARDED_ENV[*]}," \
     "args: $*" >&2

# -x NAME           copy that environment variable to every process (local and remote)
# --bind-to none    Open MPI pins each process to one core by default; a PyTorch process wants
#                   its threads and data-loader workers spread over the cores it was given
# shellcheck disable=SC2086
exec mpirun -np "$NP" --hostfile "$HOSTFILE" \
    --bind-to none \
    "${X_FLAGS[@]}" \
    ${MPIRUN_ARGS:-} \
    "$PYTHON" "$TRAIN_SCRIPT" "$@"
