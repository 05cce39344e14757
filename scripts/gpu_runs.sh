#!/usr/bin/env bash
# The GPU proofs of the guide, one per call, on the offline H200 host of this
# project's device tool (or any CUDA host with the same layout).
#
#   bash scripts/gpu_runs.sh install-bundle   # carry gpu_bundle/so, the tarball
#                                             #  and the two install scripts here,
#                                             #  gpu_bundle/whl with the next call:
#                                             #  pip install --target $SITE whl/*.whl
#   bash scripts/gpu_runs.sh install-wheels   # carry gpu_nixl (+ gpu_serve: the
#                                             #  `vllm serve` wheels and vllm-router,
#                                             #  gpu_mooncake/slim; gpu_moe: the
#                                             #  `build_bundle.sh OUT --moe` extra/*.xz,
#                                             #  for gdn), same warm machine; 64 MiB
#                                             #  a call: nixl+serve or nixl+moe
#   bash scripts/gpu_runs.sh update-package   # this tree's package files into SITE
#   bash scripts/gpu_runs.sh install-series   # the in-tree series' vLLM files
#                                             #  (gpu_series/) over SITE's vLLM,
#                                             #  the plugin removed
#   bash scripts/gpu_runs.sh RUN [ARGS...]    # RUN: serve, pull, pull-offload, push,
#                                             # mooncake, hybrid, hybrid-tp2, offload,
#                                             # prefix-hits,
#                                             # simple-offload, bench-serve,
#                                             # bench-serve-x2, bench-serve-tp2,
#                                             # bench-prefix, bench-offload,
#                                             # bench-lmcache,
#                                             # bench-offload-multi (needs
#                                             # gpu_nixl), bench-simple-offload,
#                                             # mla, mla-tp2, mla-tp2-consumer,
#                                             # gdn, gdn-tp2, mamba1 (gdn and
#                                             # gdn-tp2 need the --moe bundle),
#                                             # chaos, chaos-push, chaos-offload,
#                                             # soak, soak-control, soak-clean,
#                                             # soak-fail, tamper, kernel,
#                                             # cuda-tests
#   bash scripts/gpu_runs.sh pair RUN1 RUN2   # two-GPU host: RUN1 on GPU 0 and
#                                             # RUN2 on GPU 1 at the same time
#   bash scripts/gpu_runs.sh group RUN...     # up to 8 runs at once on one GPU
#                                             # (tiny models), NIXL ports apart;
#                                             # "RUN1 RUN2 / RUN3": RUN3 on GPU 1;
#                                             # RUN+ARG+ARG passes ARGs to RUN
#
# Each run writes its driver's output to $OUT/RUN.log (a file, not a pipe: an
# engine left behind cannot hold the call open), its summary to
# $OUT/RUN.summary.json and everything else to $OUT/RUN.tar.gz, prints the
# log's last lines, and ends every vLLM process it left. Extra ARGS go to the
# driver. SITE (default /tmp/site) is where the bundle is installed. Two runs of
# one RUN in a call overwrite each other's files unless KV_CHECKSUM_RUN_TAG=T
# names the second's RUN-T.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
site=${SITE:-/tmp/site}
out=${OUT:-/tmp/gpu_runs}
limit=${KV_CHECKSUM_RUN_LIMIT:-540}
export PYTHONPATH=$site VLLM_USE_FLASHINFER_SAMPLER=0
# Two-GPU hosts: no NVLink multicast (see ../shared/gpu and the device notes).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# Drivers that start `vllm serve` (the benchmarks, serve, chaos, soak, tamper)
# need the serve wheels of install-wheels; without them every engine ends at
# start with "No module named 'uvicorn'" (2026-12-02c: one call lost so).
needs_serve() {
    case "$1" in
    benchmarks/benchmark_kv_checksum_*.py | *kv_checksum_serve_pd.py | *kv_checksum_chaos.py) return 0 ;;
    esac
    return 1
}

run() {
    local name=$1${KV_CHECKSUM_RUN_TAG:+-$KV_CHECKSUM_RUN_TAG}
    shift
    if needs_serve "$1" && ! python3 -c "import uvicorn" 2>/dev/null; then
        echo "[gpu_runs] $name: no uvicorn in $site: run install-wheels first (carry gpu_serve)"
        return 2
    fi
    mkdir -p "$out/$name"
    echo "[gpu_runs] $name: $*"
    (cd "$repo" && timeout --kill-after=20 "$limit" python3 "$@" --out "$out/$name") \
        >"$out/$name.log" 2>&1
    local rc=$?
    # A pair's other run may still be going: its caller ends the leftovers.
    [ -n "${KV_CHECKSUM_PAIRED:-}" ] ||
        pkill -9 -f "EngineCore|vllm.entrypoints|vllm_router|kv_checksum_.*_gpu.py" 2>/dev/null
    # Few files come back from the device tool: the summary, the log, one archive.
    for summary in summary.json pd.json; do
        [ -f "$out/$name/$summary" ] && cp "$out/$name/$summary" "$out/$name.$summary"
    done
    tar -czf "$out/$name.tar.gz" -C "$out" "$name" && rm -rf "${out:?}/$name"
    tail -n 40 "$out/$name.log"
    echo "[gpu_runs] $name: exit $rc"
    return $rc
}

# The drivers' model folders (and the serve drivers' one), built once before
# runs that go at once, so that two drivers do not write the same folder.
build_models() {
    (cd "$repo/examples/disaggregated" && python3 -c "
import sys, kv_checksum_pd_gpu as d
for shape in sys.argv[1:]:
    try:
        print('[gpu_runs] model', d.build_model(shape))
    except Exception as e:
        print('[gpu_runs] model', shape, 'failed:', repr(e)[:300])
try:  # the serve drivers' model (chaos, soak, tamper)
    import argparse, kv_checksum_serve_pd as s
    s.build_model(argparse.Namespace(model='/tmp/kv-checksum-serve-tiny'))
except Exception as e:
    print('[gpu_runs] serve model failed:', repr(e)[:300])" "$@")
}

# Two runs at once on a two-GPU host, one per GPU, ports apart.
pair() {
    local first=$1 second=$2
    build_models tiny hybrid hybrid-g2
    CUDA_VISIBLE_DEVICES=0 KV_CHECKSUM_PAIRED=1 bash "$0" "$first" &
    local a=$!
    CUDA_VISIBLE_DEVICES=1 KV_CHECKSUM_PAIRED=1 KV_CHECKSUM_PORT_OFFSET=1000 \
        bash "$0" "$second" &
    local b=$!
    wait $a
    local rc_a=$?
    wait $b
    local rc_b=$?
    pkill -9 -f "EngineCore|vllm.entrypoints|vllm_router|kv_checksum_.*_gpu.py" 2>/dev/null
    echo "[gpu_runs] pair: $first exit $rc_a, $second exit $rc_b"
    [ $rc_a -eq 0 ] && [ $rc_b -eq 0 ]
}

# Several runs at once on one GPU (tiny models: memory and SMs to spare), NIXL
# ports apart; the logs and summaries come back in one archive (the device tool
# returns at most 8 files).
# A "/" between names moves the runs after it to the next GPU (GPU 0 first).
group() {
    mkdir -p "$out"
    build_models tiny mla qwen3next mamba1
    local offsets=(0 1000 10000 11000 12000 13000 14000 15000) pids=() names=()
    local i=0 gpu=0 split=0 name
    for name in "$@"; do [ "$name" = / ] && split=1; done
    for name in "$@"; do
        if [ "$name" = / ]; then
            gpu=$((gpu + 1))
            continue
        fi
        local pin=() words
        [ $split = 1 ] && pin=(CUDA_VISIBLE_DEVICES=$gpu)
        IFS=+ read -ra words <<<"$name"  # RUN+ARG+ARG: arguments of the run
        env "${pin[@]}" KV_CHECKSUM_PAIRED=1 \
            KV_CHECKSUM_PORT_OFFSET=${offsets[$i]} bash "$0" "${words[@]}" \
            >"$out/group_${words[0]}.tail" 2>&1 &
        pids+=($!)
        names+=("${words[0]}")
        i=$((i + 1))
    done
    local rc=0 j
    for j in "${!pids[@]}"; do
        wait "${pids[$j]}"
        local r=$?
        echo "[gpu_runs] group: ${names[$j]} exit $r"
        [ $r -eq 0 ] || rc=1
    done
    pkill -9 -f "EngineCore|vllm.entrypoints|vllm_router|kv_checksum_.*_gpu.py" 2>/dev/null
    for name in "${names[@]}"; do tail -n 25 "$out/group_$name.tail"; done
    (cd "$out" && shopt -s nullglob && files=(./*.log ./*.json ./*.tail) &&
        tar -czf group_logs.tar.gz "${files[@]}" && rm -f "${files[@]}")
    return $rc
}

pd=examples/disaggregated/kv_checksum_pd_gpu.py
# bench-serve-x2 and -tp2 (below).
serve8b=(benchmarks/benchmark_kv_checksum_serve.py --together --bench-batch
    --workloads 1k_c1,1k_c32,8k_burst,32k_c1 --max-model-len 40960)
what=${1:-}
shift || true
case "$what" in
pair) pair "$@" ;;
group) group "$@" ;;
install-bundle)
    SITE=$site bash "$repo/scripts/gpu_install.sh"
    ;;
# The package's files again, over what install-bundle put into $SITE (a later
# call of the same warm machine runs the working tree it was sent).
update-package)
    (cd "$repo" && find vllm/distributed/kv_transfer/kv_checksum -name '*.py' \
        -not -path '*/__pycache__/*' -exec cp --parents {} "$site/" \;)
    echo "[gpu_runs] package updated in $site"
    ;;
# The in-tree series instead of the plugin (issue 77): vLLM's files as the
# series patches them (gpu_series/, made here by `bash scripts/upstream_series.sh
# files`) over the bundle's vLLM in $SITE, the plugin and its entry point
# removed. Every later RUN then runs vLLM's own checksum code.
install-series)
    rm -rf "$site/vllm/distributed/kv_transfer/kv_checksum" "$site"/vllm_kv_checksum-*.dist-info
    # Any other metadata folder that still registers the plugin's entry point
    # (on the H100 host one survived the line above and every engine logged
    # "Failed to load plugin kv_checksum").
    grep -l "kv_checksum.plugin" "$site"/*.dist-info/entry_points.txt \
        "$site"/*.egg-info/entry_points.txt 2>/dev/null | xargs -r -n1 dirname | xargs -r rm -rf
    # install-bundle's pip build leaves vllm_kv_checksum.egg-info in this
    # checkout, and every process started here (cwd on sys.path) read the
    # plugin's entry point from it (2026-12-07: "Failed to load plugin
    # kv_checksum" in each engine of the series' runs).
    rm -rf "$repo"/*.egg-info
    cp -r "$repo/gpu_series/vllm/." "$site/vllm/"
    python3 - <<'PY' || exit 1
import importlib.metadata as m
import importlib.util
from vllm.config import KVTransferConfig
assert "enable_kv_checksum" in KVTransferConfig.__dataclass_fields__, "not the series"
assert importlib.util.find_spec("vllm.distributed.kv_transfer.kv_checksum.plugin") is None
eps = [e.value for e in m.entry_points(group="vllm.general_plugins")]
assert not any("kv_checksum" in e for e in eps), eps
print("[gpu_runs] the series' vLLM is installed; no plugin:", eps)
PY
    ;;
install-wheels)
    # gpu_bundle/whl: the bundle's dependency wheels, when the whole bundle
    # did not fit in install-bundle's call.
    for dir in gpu_bundle/whl gpu_nixl gpu_serve gpu_mooncake/slim; do
        if compgen -G "$repo/$dir/*.whl" >/dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile \
                --target "$site" "$repo/$dir"/*.whl 2>&1 | grep -v WARNING
            echo "[gpu_runs] installed $dir"
        fi
    done
    # The MoE kernels (build_bundle.sh --moe's extra/, 12.8 MiB) do not fit in
    # the bundle's call: they travel here, as gpu_moe/*.xz.
    for f in "$repo"/gpu_moe/*.xz; do
        [ -f "$f" ] || continue
        python3 -c "import lzma, shutil, sys
with lzma.open(sys.argv[1]) as i, open(sys.argv[2], 'wb') as o:
    shutil.copyfileobj(i, o, 1 << 24)" "$f" "$site/vllm/$(basename "${f%.xz}")"
        echo "[gpu_runs] installed $(basename "${f%.xz}")"
    done
    ;;
serve) run serve examples/disaggregated/kv_checksum_serve_pd.py "$@" ;;
# --parallel-start: every engine at once with a fixed KV cache (about 100 s
# instead of 50 s per engine).
pull) run pull "$pd" --phases pd,faults --parallel-start "$@" ;;
pull-offload) run pull-offload "$pd" --connector nixl-offload --phases pd,faults \
    --num-pd 60 --num-faults 40 --parallel-start "$@" ;;
push) run push "$pd" --connector nixl-push --phases pd,faults --num-pd 60 \
    --num-faults 40 --parallel-start "$@" ;;
mooncake) run mooncake "$pd" --connector mooncake --phases pd,faults --num-pd 60 \
    --num-faults 40 --parallel-start "$@" ;;
# Nemotron-H (Mamba2 + attention): vLLM 0.33.0's NIXL refuses models with
# Mamba groups only (`--model mamba2` reproduces that).
hybrid) run hybrid "$pd" --model hybrid --num-equality 20 --num-pd 60 \
    --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
hybrid-tp2) run hybrid-tp2 "$pd" --model hybrid-g2 --producer-tp 2 --phases pd \
    --num-pd 60 --parallel-start "$@" ;;
# The model families' P/D proofs (NIXL pull). 100 loads one at a
# time plus the batched round, faults at rate 0.5 into every cache kind the
# model has (the injector picks the group of each fault).
# DeepSeek-V3-shaped MLA, all layers dense, TRITON_MLA (the driver forces it).
mla) run mla "$pd" --model mla --num-equality 20 --num-pd 100 \
    --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
# Replicated latent, heterogeneous TP (two GPUs): producer TP2 -> consumer TP1,
# and TP1 -> TP2 (each consumer replica checked).
mla-tp2) run mla-tp2 "$pd" --model mla --producer-tp 2 --phases pd,faults \
    --num-pd 100 --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
mla-tp2-consumer) run mla-tp2-consumer "$pd" --model mla --consumer-tp 2 \
    --phases pd,faults --num-pd 100 --num-faults 40 --fault-rate 0.5 \
    --parallel-start "$@" ;;
# Qwen3-Next-shaped GDN + attention: needs the MoE kernels (carry extra/ from
# `build_bundle.sh --moe`) and the Triton GDN prefill (the driver sets it).
gdn) run gdn "$pd" --model qwen3next --num-equality 20 --num-pd 100 \
    --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
gdn-tp2) run gdn-tp2 "$pd" --model qwen3next --producer-tp 2 --phases pd,faults \
    --num-pd 100 --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
# Jamba-shaped Mamba1 + attention, dense MLPs (one expert).
mamba1) run mamba1 "$pd" --model mamba1 --num-equality 20 --num-pd 100 \
    --num-faults 40 --fault-rate 0.5 --parallel-start "$@" ;;
offload) run offload examples/offload/kv_checksum_offload_gpu.py "$@" ;;
prefix-hits) run prefix-hits examples/offload/kv_checksum_offload_gpu.py \
    --connector simple --phases prefix "$@" ;;
# `vllm bench serve` through vllm-router, checksums off and on (8B-shaped, dummy
# weights; P and D share GPU 0 unless --gpu-d 1 is passed; on one GPU add
# --cuda-ipc-get, or NIXL pull reads over TCP).
# bench-serve --together --on-first: the on pair in the first slot (a second
# run beside the default one cancels slot bias); --together --pair-launches 2:
# both placements in one call (tiny model: about 200 s a launch), the checksum
# effect and the slot bias printed apart.
bench-serve) run bench-serve benchmarks/benchmark_kv_checksum_serve.py "$@" ;;
# Two-GPU host: the off and the on pair started at once, rounds off,on,on,off
# alternating between their routers, the reference table's four workloads, a
# round's bench runs in one process (on 2026-12-01 the four engines of -tp2
# took 202 s to start and one CLI run per workload 30-37 s: a round of five
# did not fit); -x2: P TP1 on GPU 0 -> D TP1 on GPU 1; -tp2: P TP2 -> D TP2,
# the four engines' ranks sharing GPUs 0 and 1.
bench-serve-x2) run bench-serve-x2 "${serve8b[@]}" --gpu-p 0 --gpu-d 1 "$@" ;;
bench-serve-tp2) run bench-serve-tp2 "${serve8b[@]}" --tp 2 --gpu-p 0,1 \
    --gpu-d 0,1 --util 0.22 --kv-cache-gib 16 "$@" ;;
# The kernel against the plain read and torch's int64 sum, bit identity
# checked (R133, R143; needs only torch and Triton).
kernel)
    mkdir -p "$out"
    (cd "$repo" && PYTHONPATH= timeout "$limit" python3 \
        benchmarks/kernels/benchmark_kv_checksum.py --mode kernel \
        --json "$out/kernel.json" "$@") >"$out/kernel.log" 2>&1
    rc=$?
    tail -n 30 "$out/kernel.log"
    exit $rc
    ;;
cuda-tests)
    mkdir -p "$out"
    (cd "$repo" && timeout "$limit" python3 -m pytest -p no:cacheprovider \
        --noconftest -q tests/v1/kv_connector/unit/test_kv_checksum_cuda.py \
        tests/v1/kv_connector/unit/test_kv_checksum_injector_cuda.py \
        tests/v1/kv_connector/unit/test_kv_checksum_worker_cuda.py "$@") \
        >"$out/cuda_tests.log" 2>&1
    rc=$?
    tail -n 15 "$out/cuda_tests.log"
    exit $rc
    ;;
# The cost of prefix-hit verification: `vllm bench serve`
# shared-prefix rounds against an off and an on engine started together on one GPU.
# Diagnosis: `bench-prefix --control` (A/A, both slots off), `bench-prefix --tier
# simple-stores` (store checksums without hit checks), `bench-prefix
# --profile-warmup --profile-steps 160` (a bounded trace of each engine;
# `--profile-with-stack` adds Python functions: keep the steps to ~40, the
# stacked trace of 200 tiny steps did not finish in 270 s). `--launches 2
# --swap-slots`: "on" in the second slot, then in the first; the slot bias
# cancels and is printed apart (bench-offload takes the same flags).
# `--pin-cores N`: each slot on its own N physical cores, the driver and its
# clients on the rest (the H200 host has 16 CPUs).
bench-prefix) run bench-prefix benchmarks/benchmark_kv_checksum_prefix_hits.py \
    --bench-batch "$@" ;;
# The CPU offload tier's cost, the same driver with a GPU cache
# too small for its 16 prefixes (reuses load from host): OffloadingConnector
# alone, and MultiConnector(NixlConnector, OffloadingConnector) (install-wheels
# first: NIXL). Defaults: 4 ABBA rounds, one workload; --bench-batch.
# `bench-offload+--profile-warmup` adds a torch profile of each engine's warm-up
# run, summarized into the summary (kernels, runtime calls, host waits).
bench-offload) run bench-offload benchmarks/benchmark_kv_checksum_prefix_hits.py \
    --tier offloading --bench-batch "$@" ;;
bench-offload-multi) run bench-offload-multi \
    benchmarks/benchmark_kv_checksum_prefix_hits.py --tier multi --bench-batch "$@" ;;
# The same with SimpleCPUOffloadConnector (eager stores).
# LMCacheConnectorV1 with its local CPU backend (issue 78 item 3), after
# scripts/lmcache_gpu.sh on the same warm machine (it installs lmcache there).
bench-lmcache) run bench-lmcache benchmarks/benchmark_kv_checksum_prefix_hits.py \
    --tier lmcache --bench-batch "$@" ;;
bench-simple-offload) run bench-simple-offload \
    benchmarks/benchmark_kv_checksum_prefix_hits.py --tier simple-offload \
    --bench-batch "$@" ;;
simple-offload) run simple-offload examples/offload/kv_checksum_offload_gpu.py \
    --connector simple "$@" ;;
# Faults of processes and time behind vllm-router (tiny model, fixed
# ports 8000-8600 shifted by KV_CHECKSUM_PORT_OFFSET, as `group` does). chaos:
# every scenario but the soak;
# chaos-push / chaos-offload: the client aborts over NIXL push and with the CPU
# offload tier; soak: rounds of 20,000 requests at concurrency 64 for at least
# 240 s (KV_CHECKSUM_SOAK_REQUESTS, KV_CHECKSUM_SOAK_SECONDS).
chaos) run chaos examples/disaggregated/kv_checksum_chaos.py --repeats 2 \
    --scenarios producer_kill,client_abort,consumer_restart,lease_expiry "$@" ;;
chaos-push) run chaos-push examples/disaggregated/kv_checksum_chaos.py \
    --connector nixl-push --scenarios client_abort "$@" ;;
chaos-offload) run chaos-offload examples/disaggregated/kv_checksum_chaos.py \
    --connector nixl-offload --scenarios client_abort "$@" ;;
soak) run soak examples/disaggregated/kv_checksum_chaos.py --scenarios soak \
    --soak-requests "${KV_CHECKSUM_SOAK_REQUESTS:-20000}" \
    --soak-min-s "${KV_CHECKSUM_SOAK_SECONDS:-240}" "$@" ;;
# The soak's controls: the same load with checksums off on every server and no
# injector (the wrong answers vLLM gives alone), and checksums on without faults.
soak-control) run soak-control examples/disaggregated/kv_checksum_chaos.py \
    --scenarios soak --checksums off \
    --soak-requests "${KV_CHECKSUM_SOAK_REQUESTS:-20000}" \
    --soak-min-s "${KV_CHECKSUM_SOAK_SECONDS:-240}" "$@" ;;
soak-clean) run soak-clean examples/disaggregated/kv_checksum_chaos.py \
    --scenarios soak --soak-fault-rate 0 \
    --soak-requests "${KV_CHECKSUM_SOAK_REQUESTS:-20000}" \
    --soak-min-s "${KV_CHECKSUM_SOAK_SECONDS:-240}" "$@" ;;
# The control of the soak's second-regime answers: the same load and injector
# with the consumer's kv_load_failure_policy "fail" (a failed load errors, no
# local recompute shares the batch): no answer may differ from the references.
soak-fail) run soak-fail examples/disaggregated/kv_checksum_chaos.py \
    --scenarios soak --soak-policy fail \
    --soak-requests "${KV_CHECKSUM_SOAK_REQUESTS:-20000}" \
    --soak-min-s "${KV_CHECKSUM_SOAK_SECONDS:-240}" "$@" ;;
# A proxy before the producer drops, truncates, swaps or
# garbles kv_checksums behind vllm-router; a checksums-off consumer alongside.
tamper) run tamper examples/disaggregated/kv_checksum_chaos.py --scenarios tamper "$@" ;;
*)
    sed -n '2,/passes ARGs to RUN$/p' "$0"
    exit 2
    ;;
esac
