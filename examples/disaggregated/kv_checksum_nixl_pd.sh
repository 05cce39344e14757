#!/usr/bin/env bash
# GPU recipe: a NIXL pull P/D pair with KV checksums on, behind vLLM's toy proxy.
# Needs: 2 GPUs (or one, with GPU_P=GPU_D=0 and a low --gpu-memory-utilization),
# vLLM 0.33.0 with NIXL, this package installed from the clone (pip install .),
# and vLLM's toy proxy from a vLLM 0.33.0 source checkout:
#   tests/v1/kv_connector/nixl_integration/toy_proxy_server.py (VLLM_SRC below).
# Not run on the CPU machine this project is developed on.
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-8B}
GPU_P=${GPU_P:-0}
GPU_D=${GPU_D:-1}
VLLM_SRC=${VLLM_SRC:-$HOME/vllm}
UTIL=${UTIL:-0.8}

# The producer checksums every prompt it prefills and returns the checksums in
# kv_transfer_params["kv_checksums"]; the toy proxy forwards them unchanged.
PRODUCER_CONFIG='{"kv_connector": "NixlConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"enable_kv_checksum": true}}'
# The consumer verifies every load before the request runs; a bad load is
# recomputed locally (fail-closed + recompute).
CONSUMER_CONFIG='{"kv_connector": "NixlConnector", "kv_role": "kv_both",
  "kv_load_failure_policy": "recompute",
  "kv_connector_extra_config": {"enable_kv_checksum": true,
                                "kv_checksum_fail_closed": true}}'

CUDA_VISIBLE_DEVICES=$GPU_P VLLM_NIXL_SIDE_CHANNEL_PORT=5600 \
  vllm serve "$MODEL" --port 8100 --gpu-memory-utilization "$UTIL" \
  --kv-transfer-config "$PRODUCER_CONFIG" > producer.log 2>&1 &
CUDA_VISIBLE_DEVICES=$GPU_D VLLM_NIXL_SIDE_CHANNEL_PORT=5700 \
  vllm serve "$MODEL" --port 8200 --gpu-memory-utilization "$UTIL" \
  --kv-transfer-config "$CONSUMER_CONFIG" > consumer.log 2>&1 &

for port in 8100 8200; do
  until curl -sf "localhost:$port/health" > /dev/null; do sleep 2; done
done
python "$VLLM_SRC/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py" \
  --port 8000 --prefiller-hosts localhost --prefiller-ports 8100 \
  --decoder-hosts localhost --decoder-ports 8200 > proxy.log 2>&1 &
until curl -sf localhost:8000/healthcheck > /dev/null 2>&1; do sleep 1; done

curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}"
echo
# Every load should be verified: no mismatch, no "not verified" warning.
grep -E "KV checksum mismatch|KV checksums not verified" consumer.log || \
  echo "consumer: no checksum mismatch or unverified load logged"
curl -s localhost:8200/metrics | grep '^vllm:kv_checksum' || true
