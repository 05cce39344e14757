#!/usr/bin/env bash
# One command: a NIXL pull P/D pair with KV checksums on, behind vllm-router.
#
#   MODEL=Qwen/Qwen3-8B bash examples/disaggregated/kv_checksum_router_pd.sh
#
# Starts a producer (prefill, port 8100), a consumer (decode, port 8200; fail-closed
# + recompute) and vllm-router (port 8000, `--vllm-pd-disaggregation --kv-connector
# nixl`), waits until the router answers /health, prints "ready", and runs until
# interrupted (Ctrl-C) or until one of the three exits; then it ends all three.
# Clients talk to the router: curl localhost:8000/v1/completions ...
#
# Needs vLLM 0.33.0 with NIXL, vllm-router (pip install vllm-router==0.1.17) and this
# package installed in the same environment (from the clone: pip install .).
# Settings (environment variables, defaults in brackets):
#   MODEL [Qwen/Qwen3-8B]      model path or name, the same on both instances
#   GPU_P [0], GPU_D [1]       CUDA_VISIBLE_DEVICES of producer and consumer; one GPU
#                              for both (GPU_P=GPU_D=0) needs UTIL <= 0.45 and
#                              starts the consumer after the producer is up
#   PARALLEL_START [0]         1: start both at once even on the same GPU
#   TP [1]                     tensor parallel size of each instance (GPU_P="0,1" ...)
#   UTIL [0.85]                --gpu-memory-utilization of each instance
#   CHECKSUMS [on]             "off" starts the same pair without the package's flags
#   P_PORT [8100] D_PORT [8200] ROUTER_PORT [8000] PROM_PORT [29000]
#   P_SIDE [5600] D_SIDE [5700]  NIXL side-channel ports
#   LOG_DIR [.]                producer.log, consumer.log, router.log
#   VLLM [vllm]                the vLLM CLI (e.g. "python3 -m vllm.entrypoints.cli.main")
#   ROUTER [python3 -m vllm_router.launch_router]
# Arguments after the script name go to both `vllm serve` commands.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
GPU_P=${GPU_P:-0}
GPU_D=${GPU_D:-1}
TP=${TP:-1}
UTIL=${UTIL:-0.85}
CHECKSUMS=${CHECKSUMS:-on}
P_PORT=${P_PORT:-8100}
D_PORT=${D_PORT:-8200}
ROUTER_PORT=${ROUTER_PORT:-8000}
PROM_PORT=${PROM_PORT:-29000}
P_SIDE=${P_SIDE:-5600}
D_SIDE=${D_SIDE:-5700}
LOG_DIR=${LOG_DIR:-.}
VLLM=${VLLM:-vllm}
ROUTER=${ROUTER:-python3 -m vllm_router.launch_router}
mkdir -p "$LOG_DIR"

# The producer checksums every prompt it prefills and returns the checksums in
# kv_transfer_params["kv_checksums"]; the router forwards them unchanged.
# The consumer verifies every load before the request runs; a bad load is
# recomputed locally (fail-closed + recompute).
if [ "$CHECKSUMS" = off ]; then
    PRODUCER_EXTRA='{}'
    CONSUMER_EXTRA='{}'
else
    PRODUCER_EXTRA='{"enable_kv_checksum": true}'
    CONSUMER_EXTRA='{"enable_kv_checksum": true, "kv_checksum_fail_closed": true}'
fi
PRODUCER_CONFIG="{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\",
  \"kv_connector_extra_config\": $PRODUCER_EXTRA}"
CONSUMER_CONFIG="{\"kv_connector\": \"NixlConnector\", \"kv_role\": \"kv_both\",
  \"kv_load_failure_policy\": \"recompute\",
  \"kv_connector_extra_config\": $CONSUMER_EXTRA}"

trap 'trap - EXIT INT TERM; kill 0 2>/dev/null; wait 2>/dev/null' EXIT INT TERM

wait_health() {
    until curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1; do
        if ! kill -0 "$2" 2>/dev/null; then
            echo "[router_pd] $3 exited before it was ready; see $LOG_DIR/$3.log" >&2
            exit 1
        fi
        sleep 2
    done
}

CUDA_VISIBLE_DEVICES=$GPU_P VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 \
    VLLM_NIXL_SIDE_CHANNEL_PORT=$P_SIDE \
    $VLLM serve "$MODEL" --host 127.0.0.1 --port "$P_PORT" \
    --tensor-parallel-size "$TP" --gpu-memory-utilization "$UTIL" \
    --kv-transfer-config "$PRODUCER_CONFIG" "$@" >"$LOG_DIR/producer.log" 2>&1 &
producer_pid=$!
# Two instances on the same GPUs: vLLM's memory profiling at start-up must not
# see the other one's memory move, so the consumer starts once the producer is
# up (PARALLEL_START=1 skips the wait, e.g. with --kv-cache-memory-bytes, which
# skips the profiling).
if [ "$GPU_P" = "$GPU_D" ] && [ "${PARALLEL_START:-0}" != 1 ]; then
    wait_health "$P_PORT" "$producer_pid" producer
fi
CUDA_VISIBLE_DEVICES=$GPU_D VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1 \
    VLLM_NIXL_SIDE_CHANNEL_PORT=$D_SIDE \
    $VLLM serve "$MODEL" --host 127.0.0.1 --port "$D_PORT" \
    --tensor-parallel-size "$TP" --gpu-memory-utilization "$UTIL" \
    --kv-transfer-config "$CONSUMER_CONFIG" "$@" >"$LOG_DIR/consumer.log" 2>&1 &
consumer_pid=$!
wait_health "$P_PORT" "$producer_pid" producer
wait_health "$D_PORT" "$consumer_pid" consumer

$ROUTER --vllm-pd-disaggregation --kv-connector nixl --policy round_robin \
    --prefill "http://127.0.0.1:$P_PORT" --decode "http://127.0.0.1:$D_PORT" \
    --host 127.0.0.1 --port "$ROUTER_PORT" --prometheus-port "$PROM_PORT" \
    >"$LOG_DIR/router.log" 2>&1 &
router_pid=$!
wait_health "$ROUTER_PORT" "$router_pid" router
echo "[router_pd] ready: http://127.0.0.1:$ROUTER_PORT (checksums $CHECKSUMS)"
# Run until one of the three ends (or a signal); the trap ends the others.
wait -n
echo "[router_pd] a process ended; stopping the others" >&2
