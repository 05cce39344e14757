# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Test deployments only: corrupt KV stored in LMCache's local CPU backend.

On PYTHONPATH with KVC_LMCACHE_CORRUPT=1 (scripts/lmcache_gpu_driver.py, mode
"corrupt"), every Python process of the server imports this. When LMCache's
local_cpu_backend module is first imported, its LocalCPUBackend's three
retrieval methods are wrapped: the first time a stored chunk (a MemoryObj) is
handed out, one bit of its first byte is flipped in place, so that load and
every later load of the chunk carry a wrong byte, as a bad host copy would.
Each flip logs "KVC corrupt: <key>". Nothing happens without the variable.
"""

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "lmcache.v1.storage_backend.local_cpu_backend"


def _flip(objs, keys, done):
    for obj, key in zip(objs, keys):
        if obj is None or id(obj) in done or obj.tensor is None:
            continue
        done.add(id(obj))
        obj.tensor.view(-1).view(dtype=__import__("torch").uint8)[0] ^= 0x01
        print(f"KVC corrupt: {key}", file=sys.stderr, flush=True)
        return  # one chunk per retrieval


def _patch(module):
    cls = module.LocalCPUBackend
    done: set[int] = set()
    get_blocking = cls.get_blocking
    batched_blocking = cls.batched_get_blocking
    batched_async = cls.batched_get_non_blocking

    def get(self, key):
        obj = get_blocking(self, key)
        _flip([obj], [key], done)
        return obj

    def batched(self, keys, *args, **kwargs):
        objs = batched_blocking(self, keys, *args, **kwargs)
        _flip(objs, keys, done)
        return objs

    async def batched_nb(self, lookup_id, keys, *args, **kwargs):
        objs = await batched_async(self, lookup_id, keys, *args, **kwargs)
        _flip(objs, keys, done)
        return objs

    setattr(cls, "get_blocking", get)  # noqa: B010 - a method of LMCache's
    setattr(cls, "batched_get_blocking", batched)  # noqa: B010
    setattr(cls, "batched_get_non_blocking", batched_nb)  # noqa: B010


class _Finder(importlib.abc.MetaPathFinder):
    """Patches the module right after it executes."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        setattr(spec.loader, "exec_module", exec_and_patch)  # noqa: B010
        return spec


if os.environ.get("KVC_LMCACHE_CORRUPT") == "1":
    sys.meta_path.insert(0, _Finder())
