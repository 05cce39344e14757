#!/usr/bin/env bash
# The main job: a P/D simulation on CPU showing every injected KV fault caught.
# Builds (once) or reuses the project's environment, then runs the demo.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/env.sh")
cd "$repo"
exec "$venv/bin/python" examples/disaggregated/kv_checksum_pd_demo.py "$@"
