#!/usr/bin/env bash
# On the offline GPU host: unpack the vLLM 0.33.0 bundle (built by
# ../shared/gpu/build_bundle.sh into gpu_bundle/) into $SITE and install this
# package with its vllm.general_plugins entry point into the same folder.
# Falls back to copying the package and writing its dist-info by hand when the
# host's setuptools cannot build it offline.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${SITE:-/tmp/site}
export SITE=$site
bash "$repo/gpu_bundle/install_bundle.sh"
if ! bash "$repo/gpu_bundle/install_project.sh" "$repo" 2>/tmp/install_project.err; then
    echo "install_project.sh failed ($(tail -n 1 /tmp/install_project.err)); manual install"
    # The whole package tree (subpackages included), without bytecode caches.
    (cd "$repo" && find vllm/distributed/kv_transfer/kv_checksum -name '*.py' \
        -not -path '*/__pycache__/*' -exec cp --parents {} "$site/" \;)
    info="$site/vllm_kv_checksum-0.1.0.dist-info"
    mkdir -p "$info"
    printf 'Metadata-Version: 2.1\nName: vllm-kv-checksum\nVersion: 0.1.0\n' > "$info/METADATA"
    printf '[vllm.general_plugins]\nkv_checksum = vllm.distributed.kv_transfer.kv_checksum.plugin:register\n' \
        > "$info/entry_points.txt"
    : > "$info/RECORD"
fi
PYTHONPATH=$site python3 -c "
import importlib.metadata as m
eps = [e.value for e in m.entry_points(group='vllm.general_plugins')]
assert 'vllm.distributed.kv_transfer.kv_checksum.plugin:register' in eps, eps
print('entry point installed:', eps)"
