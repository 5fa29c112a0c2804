#!/usr/bin/env bash
# One vLLM server on this node (srun task, started by rolloutd.sbatch when
# ROLLOUTD_VLLM_MODEL is set), registered as a backend with every daemon of the job.
#
# ROLLOUTD_VLLM_MODEL   model to serve (required)
# ROLLOUTD_VLLM_PORT    port (default 8100)
# ROLLOUTD_VLLM_TP      tensor-parallel size (default: the GPUs visible on this node)
# ROLLOUTD_VLLM_ARGS    extra `vllm serve` arguments (e.g. "--max-model-len 16384")
# ROLLOUTD_VLLM_START_TIMEOUT_S  bound on loading the model (default 1800)
set -euo pipefail

log() { printf '[vllm.sh %s %s] %s\n' "$(hostname -s)" "$(date +%T)" "$*" >&2; }
model=${ROLLOUTD_VLLM_MODEL:?set ROLLOUTD_VLLM_MODEL}
port=${ROLLOUTD_VLLM_PORT:-8100}
node=${SLURMD_NODENAME:-$(hostname -s)}
if [[ -n ${ROLLOUTD_VLLM_TP:-} ]]; then
    tp=$ROLLOUTD_VLLM_TP
elif [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
    tp=$(awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES")
else
    tp=$(nvidia-smi -L 2>/dev/null | wc -l)
fi
((tp > 0)) || { log "no GPU on this node"; exit 1; }

# vLLM runs as our child so we can register it once it is up; we pass signals on.
vllm serve "$model" --host 0.0.0.0 --port "$port" --tensor-parallel-size "$tp" \
    ${ROLLOUTD_VLLM_ARGS:-} &
vllm=$!
trap 'kill -TERM "$vllm" 2>/dev/null || true' TERM INT

deadline=$((SECONDS + ${ROLLOUTD_VLLM_START_TIMEOUT_S:-1800}))
until curl -fsS -o /dev/null --max-time 2 "http://127.0.0.1:$port/health" 2>/dev/null; do
    kill -0 "$vllm" 2>/dev/null || { log "vllm serve exited"; wait "$vllm"; exit 1; }
    ((SECONDS < deadline)) || { log "vLLM not healthy in time"; kill -TERM "$vllm"; wait "$vllm"; exit 1; }
    sleep 2
done
log "vLLM $model healthy on :$port (tp=$tp)"

# Register with every daemon (POST /v1/backends); retried until it answers, bounded.
auth="Authorization: Bearer $(cat "$ROLLOUTD_TOKEN_FILE")"
body=$(printf '{"kind": "vllm", "url": "http://%s:%s", "model": "%s"}' "$node" "$port" "$model")
while read -r daemon; do
    for _ in $(seq 60); do
        if curl -fsS -o /dev/null --max-time 5 -X POST -H @<(echo "$auth") \
                -H 'Content-Type: application/json' -d "$body" "$daemon/v1/backends"; then
            log "registered with $daemon"; break
        fi
        sleep 2
    done
done <"$ROLLOUTD_RUN_DIR/seeds"

status=0
while kill -0 "$vllm" 2>/dev/null; do wait "$vllm" || status=$?; done
exit "$status"
