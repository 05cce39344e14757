# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An engine's KV_CHECKSUM_TRIAL (`kv_checksum_trials.py`), then the next
`sitecustomize.py` on the path (the hook timer's, where installed), as if this
one were not there."""

import importlib.util
import os
import sys
from pathlib import Path

_here = Path(__file__).resolve()
sys.path.insert(0, str(_here.parent.parent))
try:
    import kv_checksum_trials

    kv_checksum_trials.install(os.environ.get("KV_CHECKSUM_TRIAL", ""))
finally:
    sys.path.remove(str(_here.parent.parent))

for _entry in sys.path:
    _next = Path(_entry or ".") / "sitecustomize.py"
    if _next.is_file() and _next.resolve() != _here:
        _spec = importlib.util.spec_from_file_location("_next_sitecustomize", _next)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
