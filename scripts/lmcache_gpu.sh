#!/usr/bin/env bash
# LMCacheConnectorV1 (lmcache 0.5.6, local CPU backend) with checksums on the
# offline GPU host, after `scripts/gpu_runs.sh install-bundle` on the same warm
# machine. Build first, on the CPU machine:
#   bash scripts/lmcache_bundle.sh gpu_lmcache   # about 21 MB (lmcache + deps)
#   bash scripts/lmcache_cuda_ops.sh             # gpu_lmcache/ops: its CUDA ops
# then, after `bash scripts/gpu_runs.sh install-bundle` (carry gpu_bundle/so,
# its tarball and install scripts), one call carrying gpu_bundle/whl and
# gpu_lmcache (lmcache, its small deps and the `vllm serve` wheels):
#   bash scripts/lmcache_gpu.sh [DRIVER ARGS...]
#   bash scripts/lmcache_gpu.sh install         # the install and preflight alone
#   OUT=DIR bash scripts/lmcache_gpu.sh run [DRIVER ARGS...]   # the driver alone
# (two drivers at once after one install: `run --port 8400 --connector ...`).
# Steps: install the wheels into $SITE, refresh this tree's package there, check
# that LMCache and its CUDA ops import (under the host's torch), then run
# scripts/lmcache_gpu_driver.py (modes off, on, fault, corrupt). Everything
# goes under $OUT: preflight.log, lmcache.log, summary.json, lmcache.tar.gz
# (server logs and /metrics lines).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${SITE:-/tmp/site}
out=${OUT:-/tmp/lmcache_gpu}
mkdir -p "$out"
export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0 LMCACHE_TRACK_USAGE=false

step=all
case "${1:-}" in
install | run) step=$1 && shift ;;
esac

install() {
for dir in gpu_bundle/whl gpu_lmcache; do
    if compgen -G "$repo/$dir/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile \
            --target "$site" "$repo/$dir"/*.whl 2>&1 | grep -v WARNING
        echo "[lmcache_gpu] installed $dir"
    fi
done
# LMCache's CUDA ops rebuilt for the host's torch (scripts/lmcache_cuda_ops.sh),
# over the wheel's, which do not load there.
if compgen -G "$repo/gpu_lmcache/ops/cuda_ops.*.so" >/dev/null; then
    cp "$repo"/gpu_lmcache/ops/cuda_ops.*.so "$site/lmcache/"
    echo "[lmcache_gpu] installed the rebuilt lmcache.cuda_ops"
    export KV_CHECKSUM_LMCACHE_OPS_REQUIRED=1
fi
(cd "$repo" && find vllm/distributed/kv_transfer/kv_checksum -name '*.py' \
    -not -path '*/__pycache__/*' -exec cp --parents {} "$site/" \;)

# LMCache's CUDA ops link libtorch's unstable C++ ABI: the published wheel's
# do not load under the GPU host's torch 2.11 (undefined c10 symbols), and
# LMCache then runs its torch fallback copies. With the rebuilt ops installed
# their import is required; without, it may fail. The other imports are
# required (the vLLM adapter needs cryptography).
python3 - >"$out/preflight.log" 2>&1 <<'PY'
import importlib, os, sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
ok = True
for name in ("lmcache", "lmcache.lmcache_native", "lmcache.cuda_ops",
             "lmcache.integration.vllm.vllm_v1_adapter", "uvicorn"):
    try:
        importlib.import_module(name)
        print("import", name, "ok")
    except Exception as e:
        ok = ok and name == "lmcache.cuda_ops" and not os.environ.get(
            "KV_CHECKSUM_LMCACHE_OPS_REQUIRED")
        print("import", name, "FAILED:", repr(e)[:400])
sys.exit(0 if ok else 3)
PY
rc=$?
cat "$out/preflight.log"
[ $rc -eq 0 ] || { echo "[lmcache_gpu] preflight failed"; exit $rc; }
}

[ $step = run ] || install
[ $step = install ] && exit 0

(cd "$repo" && timeout --kill-after=20 "${KV_CHECKSUM_RUN_LIMIT:-540}" python3 \
    scripts/lmcache_gpu_driver.py --out "$out/lmcache" "$@") >"$out/lmcache.log" 2>&1
rc=$?
# Leftover servers; KV_CHECKSUM_PAIRED=1: another run shares the machine, and
# the caller ends them when both are done.
[ -n "${KV_CHECKSUM_PAIRED:-}" ] || pkill -9 -f "EngineCore|vllm.entrypoints" 2>/dev/null
[ -f "$out/lmcache/summary.json" ] && cp "$out/lmcache/summary.json" "$out/summary.json"
tar -czf "$out/lmcache.tar.gz" --exclude="storage-*" -C "$out" lmcache && rm -rf "${out:?}/lmcache"
tail -n 30 "$out/lmcache.log"
echo "[lmcache_gpu] exit $rc"
exit $rc
