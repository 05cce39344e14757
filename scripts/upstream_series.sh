#!/usr/bin/env bash
# Apply the in-tree patch series upstream/*.patch to vLLM 0.33.0's source
# archive in a scratch git repository, lay the patched Python files over the
# project virtualenv's installed vLLM in a separate environment, and run vLLM's
# own tests with and without the series (see upstream/README.md).
#
#   bash scripts/upstream_series.sh [--upto N] [--each] [--tests PATH ...]
#        [--rebaseline] [--no-tests] [--timeout SECONDS] [--out DIR]
#   bash scripts/upstream_series.sh tree [--upto N]   # the tree, to edit a commit
#   bash scripts/upstream_series.sh export            # the tree's commits -> upstream/
#
# Everything it makes lives in the cache folder next to the virtualenv
# (~/.cache/vllm-kv-checksum/upstream-series; the archive is shared with
# scripts/upstream_tests.sh), never in the clone. Exit status: 0 all checks
# passed, 1 a check failed, 2 set-up error, 3 PyPI unreachable.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/env.sh")
cache=${KV_CHECKSUM_SERIES_CACHE:-$(dirname "$venv")/upstream-series}
exec nice "$venv/bin/python" "$repo/scripts/upstream_series.py" --cache "$cache" "$@"
