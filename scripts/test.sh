#!/usr/bin/env bash
# The project's test command: build or reuse the cached environment, then run the
# CPU test suite, ruff, mypy and the promtool checks of the alert rules
# (scripts/check_alerts.sh: skipped, saying so, where promtool cannot be had).
# Exits non-zero on any failure or if no test ran.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/env.sh")
cd "$repo"
"$venv/bin/ruff" check .
"$venv/bin/ruff" format --check .
"$venv/bin/mypy"
bash "$repo/scripts/check_alerts.sh"
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "no tests were collected: failing" >&2
    exit 1
fi
exit "$rc"
