#!/usr/bin/env bash
# One rolloutd daemon as one srun task (started by rolloutd.sbatch; usable with any srun).
#
# Port: ROLLOUTD_PORT + SLURM_LOCALID, so several daemons can share a node.
# Node id "<node>:<port>"; advertised URL http://<node>:<port> (the same names the seeds use).
# State dir: node-local, per job and port. The daemon is exec'ed: it is the task, it gets
# Slurm's SIGTERM, and its exit status is the task's.
set -euo pipefail

port=$(( ${ROLLOUTD_PORT:-8400} + ${SLURM_LOCALID:-0} ))
node=${SLURMD_NODENAME:-$(hostname -s)}

export ROLLOUTD_NODE_ID=${ROLLOUTD_NODE_ID:-$node:$port}
export ROLLOUTD_URL=${ROLLOUTD_URL:-http://$node:$port}
export ROLLOUTD_STATE_DIR=${ROLLOUTD_STATE_DIR:-${ROLLOUTD_LOCAL_DIR:-${TMPDIR:-/tmp}}/rolloutd-${SLURM_JOB_ID:-0}-$port}
export ROLLOUTD_DRAIN_TIMEOUT_S=${ROLLOUTD_DRAIN_TIMEOUT_S:-20}
: "${ROLLOUTD_TOKEN_FILE:?ROLLOUTD_TOKEN_FILE must name the job token (0600)}"
: "${ROLLOUTD_SEEDS:?ROLLOUTD_SEEDS must list the daemons URLs, comma-separated}"
mkdir -p "$ROLLOUTD_STATE_DIR"

args=(serve --host "${ROLLOUTD_BIND_HOST:-0.0.0.0}" --port "$port")
[[ -n ${ROLLOUTD_CONFIG:-} ]] && args+=(--config "$ROLLOUTD_CONFIG")
echo "launch.sh: $ROLLOUTD_NODE_ID on $ROLLOUTD_URL, state $ROLLOUTD_STATE_DIR" >&2
bin=${ROLLOUTD_BIN:-rolloutd}
# The daemon rejects ROLLOUTD_* variables that are not settings (to catch typos), so the
# launchers' own variables are dropped here.
for v in $(compgen -e | grep '^ROLLOUTD_'); do
  case $v in
    ROLLOUTD_BIN|ROLLOUTD_BIND_HOST|ROLLOUTD_CONFIG|ROLLOUTD_CONTRIB_DIR|ROLLOUTD_DAEMONS_PER_NODE|\
    ROLLOUTD_LOCAL_DIR|ROLLOUTD_RUN_DIR|ROLLOUTD_SRUN_ARGS|ROLLOUTD_START_TIMEOUT_S|ROLLOUTD_VLLM_*)
      unset "$v" ;;
  esac
done
exec $bin "${args[@]}"
