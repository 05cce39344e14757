#!/usr/bin/env bash
# Build step, on the CPU machine (nvcc 13.0 and PyPI reachable): LMCache
# 0.5.6's CUDA ops (`lmcache.cuda_ops`) compiled from its sdist against the GPU
# host's torch 2.11.0+cu130 for Python 3.12 and sm_90 (H100/H200).
# The published lmcache 0.5.6 wheel's cuda_ops were built against another torch
# and do not load on the host (undefined symbol c10::NotImplementedError);
# LMCache then falls back to torch copies that write vLLM's fused per-head K/V
# layout to the wrong places (results page, L1-L2). The other extensions of the
# wheel link no torch symbol and are used as published.
#   bash scripts/lmcache_cuda_ops.sh [OUTDIR]   # default gpu_lmcache/ops
# Needs: nvcc (CUDA 13.0) under $CUDA_HOME (default /usr/local/cuda) and a
# CPython 3.12 with headers ($PYTHON312, default pyenv's 3.12.1). Took about
# 7 min on two cores (one nvcc at a time: each needs about 3 GB). The result
# (one .so, 3.6 MB after strip) is copied over the wheel's by
# scripts/lmcache_gpu.sh. Work files go to $WORK (default
# ~/.cache/vllm-kv-checksum/lmcache-build), never into the clone.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=$(realpath -m "${1:-$repo/gpu_lmcache/ops}")
work=${WORK:-$HOME/.cache/vllm-kv-checksum/lmcache-build}
py312=${PYTHON312:-$HOME/.pyenv/versions/3.12.1/bin/python3.12}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p "$work" "$out"
cd "$work"

if [ ! -d lmcache-0.5.6 ]; then
    url=$(curl -fsS https://pypi.org/simple/lmcache/ \
        | grep -o 'https://[^"#]*/lmcache-0\.5\.6\.tar\.gz' | head -1)
    curl -fsSL -o lmcache-0.5.6.tar.gz "$url"
    tar xzf lmcache-0.5.6.tar.gz
fi
if [ ! -x venv312/bin/python ]; then
    "$py312" -m venv venv312
    # torch's CUDA wheels load these libraries at import; cpp_extension
    # imports torch. Versions are torch 2.11.0's own pins.
    venv312/bin/pip install -q --no-deps torch==2.11.0
    venv312/bin/pip install -q numpy "setuptools<82" wheel ninja \
        typing_extensions sympy filelock jinja2 networkx fsspec \
        "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.2" \
        nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 \
        nvidia-nccl-cu13==2.28.9 nvidia-nvshmem-cu13==3.4.5
fi
venv312/bin/python -c "import torch; assert torch.__version__.startswith('2.11.0'), torch.__version__; assert torch.version.cuda == '13.0', torch.version.cuda"

# The source list and flags are those of lmcache 0.5.6's own CUDA build
# profile (setup_extensions/build_profiles/cuda.py), for one target only.
cat > setup_cuda_ops.py <<'PY'
import os

import nvidia
from setuptools import setup
from torch.utils import cpp_extension

src = os.path.abspath("lmcache-0.5.6")
names = ["pybind.cpp", "mem_kernels.cu", "mp_mem_kernels.cu",
         "phase_timing_recorder.cu", "blend_kernels.cu", "cal_cdf.cu",
         "ac_enc.cu", "ac_dec.cu", "pos_kernels.cu", "mem_alloc.cpp",
         "utils.cpp", "event_recorder.cpp", "completion_recorder.cpp"]
abi = "-D_GLIBCXX_USE_CXX11_ABI=1"
setup(
    name="lmcache-cuda-ops",
    ext_modules=[cpp_extension.CUDAExtension(
        "lmcache.cuda_ops",
        sources=[os.path.join(src, "csrc", "cuda", n) for n in names],
        # cusparse.h and the other headers torch's CUDA headers include come
        # with torch's pip CUDA packages, not with a compiler-only toolkit.
        include_dirs=[os.path.join(src, "csrc"), os.path.join(
            list(nvidia.__path__)[0], "cu13", "include")],
        extra_compile_args={"cxx": [abi, "-O2"], "nvcc": [abi, "-O2"]},
    )],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
PY
mkdir -p lmcache  # build_ext --inplace copies the module there
TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-1} nice venv312/bin/python \
    setup_cuda_ops.py build_ext --inplace
so=$(ls lmcache/cuda_ops.cpython-312-x86_64-linux-gnu.so)
strip --strip-unneeded -o "$out/$(basename "$so")" "$so"
ls -l "$out"
