# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Slim the Mooncake transfer-engine wheel to what vLLM's MooncakeConnector loads.

vLLM 0.33.0's MooncakeConnector imports only `mooncake.engine.TransferEngine`.
The 47 MiB wheel also ships the store, EP, process-group and CLI parts; this
keeps `mooncake/__init__.py`, `engine.so` (+ its `.pyi`), the two libraries
it links from `mooncake/` (libasio, libetcd_wrapper) and the four bundled
libraries it links from the wheel's `.libs` (yaml-cpp, jsoncpp, glog,
gflags), rewrites RECORD, and writes a wheel of the same name (about 10 MiB)
that fits in one device call next to NIXL's.

Usage: python scripts/repack_mooncake.py IN.whl OUTDIR
"""

import base64
import hashlib
import os
import sys
import zipfile

KEEP_PREFIXES = (
    "mooncake/__init__.py",
    "mooncake/engine.so",
    "mooncake/engine.pyi",
    "mooncake/py.typed",
    "mooncake/libasio.so",
    "mooncake/libetcd_wrapper.so",
    "mooncake_transfer_engine_cuda13.libs/libyaml-cpp-",
    "mooncake_transfer_engine_cuda13.libs/libjsoncpp-",
    "mooncake_transfer_engine_cuda13.libs/libglog-",
    "mooncake_transfer_engine_cuda13.libs/libgflags-",
)


def keep(name: str) -> bool:
    return name.startswith(KEEP_PREFIXES) or (
        ".dist-info/" in name and not name.endswith("RECORD")
    )


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"{name},sha256={digest.decode()},{len(data)}"


def main() -> int:
    src, out_dir = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    dst = os.path.join(out_dir, os.path.basename(src))
    lines = []
    with (
        zipfile.ZipFile(src) as zin,
        zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            if not keep(info.filename):
                continue
            data = zin.read(info)
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            lines.append(record_line(info.filename, data))
        lines.append(f"{record},,")
        zout.writestr(record, "\n".join(lines) + "\n")
    print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB, {len(lines) - 1} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
