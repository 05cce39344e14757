#!/usr/bin/env bash
# Build step, on the CPU machine (PyPI reachable): the small bundle of the
# LMCache GPU run (scripts/lmcache_gpu.sh), for the GPU host's Python 3.12.
# LMCache 0.5.6's wheel (17.7 MB), the pure-Python modules it imports that
# the host and gpu_bundle lack, and the `vllm serve` wheels
# (../shared/gpu/serve_wheels.txt); everything else it names (torch,
# transformers, numba, aiohttp, prometheus_client, msgspec, pyzmq, ...) is on
# the host already. Carry OUTDIR (default gpu_lmcache, git-ignored, about
# 22 MB) with gpu_bundle/whl (19 MB) in the call after install-bundle.
set -euo pipefail
out=${1:-gpu_lmcache}
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out" \
    lmcache==0.5.6 aiofile caio aiofiles py-cpuinfo nvtx sortedcontainers redis \
    cryptography cffi pycparser \
    $(grep -v '^#' "$(dirname "$0")/../../shared/gpu/serve_wheels.txt")
ls -l "$out"
du -sh "$out"
