#!/usr/bin/env bash
# Maintainer check of the packaging (issue: foundation): a regular `pip install .`
# puts the package inside the installed vllm tree with its entry point, and
# `pip uninstall vllm-kv-checksum` removes only this package's files. Restores
# the editable install afterwards.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$repo/scripts/env.sh")
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$venv/bin/pip" install -q --no-deps "$repo" >/dev/null 2>&1
(cd / && "$venv/bin/python" - "$site" <<'PY'
import importlib.metadata as m
import sys

import vllm
import vllm.distributed.kv_transfer.kv_checksum as pkg

site = sys.argv[1]
assert vllm.__file__.startswith(site), vllm.__file__
assert pkg.__file__.startswith(site), pkg.__file__
assert any(e.name == "kv_checksum" for e in m.entry_points(group="vllm.general_plugins"))
print("pip install .: package in", pkg.__file__)
PY
) 2>&1 | grep -v "^W1129"
"$venv/bin/pip" uninstall -y -q vllm-kv-checksum
test ! -e "$site/vllm/distributed/kv_transfer/kv_checksum"
test -e "$site/vllm/distributed/kv_transfer/kv_connector/factory.py"
echo "pip uninstall: package removed, vllm's own files kept"
"$venv/bin/pip" install -q --no-deps -e "$repo" >/dev/null 2>&1
echo "editable install restored"
