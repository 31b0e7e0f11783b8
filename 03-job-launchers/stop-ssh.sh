#!/bin/bash
# Stop what launch-ssh.sh started: kill the tmux sessions on every host of the hosts file.
# Killing a session sends SIGHUP to torchrun, which then terminates its worker processes.
#
# Usage: 03-job-launchers/stop-ssh.sh HOSTS_FILE [-e EXPERIMENT]
#   With -e (or the whole training command line, which contains it): host i's session
#   train-<experiment>-<i> only. Without: every train-*-<i> session on host i.
# Environment: SSH (default "ssh"), as for launch-ssh.sh; a host named localhost needs no ssh.
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 HOSTS_FILE [-e EXPERIMENT]" >&2; exit 2; }
HOSTS_FILE=$1; shift
SSH=${SSH:-ssh}
# Run a shell command on a host: over ssh, or right here for "localhost" (as launch-ssh.sh does).
on_host() {
    # shellcheck disable=SC2086
    if [ "$1" = localhost ]; then bash -c "$2"; else $SSH "$1" "$2"; fi
}
mapfile -t LINES < <(sed -e 's/#.*//' "$HOSTS_FILE" | awk 'NF')

EXP=
for ((i = 1; i <= $#; i++)); do
    case ${!i} in
        -e | --experiment-name) j=$((i + 1)); EXP=${!j:-} ;;
        --experiment-name=*) EXP=${!i#*=} ;;
    esac
done
EXP=${EXP//[^A-Za-z0-9_-]/_}   # same clean-up as launch-ssh.sh

for i in "${!LINES[@]}"; do
    read -r host _ <<<"${LINES[$i]}"
    if [ -n "$EXP" ]; then
        select="grep -Fx train-$EXP-$i"           # exactly this session
    else
        select="grep -E '^train-.*-$i\$'"         # any experiment's session for host i
    fi
    # List this host's sessions, keep ours, kill each by exact name ("=name": no prefix matching).
    remote="tmux ls -F '#{session_name}' 2>/dev/null | $select |
        while read -r s; do tmux kill-session -t \"=\$s\" && echo \"$host: stopped \$s\"; done; true"
    on_host "$host" "$remote"
done
