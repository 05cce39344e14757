#!/usr/bin/env bash
# Create (once) or reuse the project's virtual environment and print its path.
# The environment lives outside the clone, in a cache folder keyed by a hash of
# pyproject.toml, so repeated runs and CI reuse it; KV_CHECKSUM_VENV overrides it.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
key=$(sha256sum "$repo/pyproject.toml" | cut -c1-12)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/vllm-kv-checksum
venv=${KV_CHECKSUM_VENV:-$cache/venv-$key}
mkdir -p "$(dirname "$venv")"
# One builder at a time: concurrent callers wait for the first one's build.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
    echo "[env] building $venv (vLLM 0.33.0 with CUDA torch: about 6 minutes)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    log="$venv.log"
    {
        "$venv/bin/pip" install --upgrade pip
        "$venv/bin/pip" install "vllm==0.33.0"
        "$venv/bin/pip" install -e "$repo[test]"
    } >"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "[env] install failed, see $log" >&2; exit 1; }
    touch "$venv/.complete"
elif [ "$(cd / && "$venv/bin/python" -c 'import importlib.metadata as m, json; d = m.distribution("vllm-kv-checksum"); print(json.loads(d.read_text("direct_url.json") or "{}").get("url", ""))' 2>/dev/null)" != "file://$repo" ]; then
    # Same dependencies, but this clone is not the one installed editable.
    "$venv/bin/python" -m pip install -q --no-deps -e "$repo" >>"$venv.log" 2>&1 \
        || { tail -n 20 "$venv.log" >&2; exit 1; }
fi
echo "$venv"
