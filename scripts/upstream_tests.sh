#!/usr/bin/env bash
# Run vLLM 0.33.0's own tests/v1/kv_connector/unit (from its PyPI source
# archive) three ways: plugin not loaded, loaded with checksums off, loaded with
# checksums forced on (fail-open); print per-file counts side by side and every
# test whose result differs from the run without the plugin.
#
#   bash scripts/upstream_tests.sh [--modes none,off,on] [--jobs N]
#        [--timeout SECONDS] [--out DIR] [FILE ...]
#
# FILEs are relative to tests/v1/kv_connector/unit (default: all of it).
# Downloads and logs go to the cache folder next to the project's virtualenv
# (~/.cache/vllm-kv-checksum/upstream), never into the repository. Exit status:
# 0 no unexplained difference, 1 differences (or failures in a single-mode
# run), 2 set-up error, 3 PyPI unreachable. See docs/design/kv_checksum.md.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/env.sh")
cache=${KV_CHECKSUM_UPSTREAM_CACHE:-$(dirname "$venv")/upstream}
exec nice "$venv/bin/python" "$repo/scripts/upstream_tests.py" --cache "$cache" "$@"
