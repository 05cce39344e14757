# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Run vLLM 0.33.0's own KV-connector unit tests with and without the plugin.

Called by scripts/upstream_tests.sh with the project's virtualenv Python; see
docs/design/kv_checksum.md ("vLLM's own tests with the plugin"). Steps:

1. Fetch vLLM 0.33.0's source archive from PyPI's simple index (sha256
   checked) into CACHE (next to the virtualenv, never into the repository)
   and unpack its tests/, examples/ and pyproject.toml.
2. Install the extra test dependencies vLLM's tests import (tblib,
   pytest-asyncio, pytest-timeout, msgpack, ray) into CACHE/deps with
   ``pip --target``, only if missing: the project's virtualenv is not changed.
3. Write the config.json (no weights, no tokenizer) of the models the tests
   name into a private HF_HOME and run offline: there is no hub access here.
4. Run tests/v1/kv_connector/unit (or the files given) once per mode, on CPU
   with the V2 model runner, each in its own network namespace when
   ``unshare`` is available (so parallel modes never share a port):
   ``none`` (plugin not loaded: its entry point hidden from vLLM's plugin
   loader), ``off`` (loaded, checksums off), ``on``
   (loaded, ``enable_kv_checksum`` forced on in every KVTransferConfig,
   fail-open).
5. Print per-file passed/failed/skipped counts side by side and every test
   whose result differs from the ``none`` run (or, without a ``none`` run,
   every test that failed), with the documented reason where one exists.

Exit status: 0 when no test differs without a documented reason (a single
mode: when none failed), 1 otherwise, 2 on a usage or set-up error, 3 when
PyPI cannot be reached (nothing to test against).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import html.parser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.33.0"
SDIST = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
UNIT = "tests/v1/kv_connector/unit"
MODES = ("none", "off", "on")
PLUGIN_NAME = "kv_checksum"
SCRIPTS = Path(__file__).resolve().parent
EXIT_UNREACHABLE = 3

# Extra test dependencies of vLLM's tests (pinned as in its
# requirements/test/cpu.txt): import name -> requirement.
TEST_DEPS = {
    "tblib": "tblib==3.1.0",
    "pytest_asyncio": "pytest-asyncio==1.4.0",
    "pytest_timeout": "pytest-timeout==2.3.1",
    "msgpack": "msgpack==1.2.3",
    "ray": "ray==2.56.1",
}

# Tests whose result with the plugin may differ from the run without it,
# and why (the guide documents each). Keys: (mode, test id).
DOCUMENTED_DIFFERENCES: dict[tuple[str, str], str] = {}


class Unreachable(Exception):
    """PyPI (the index or the file host) could not be reached."""


def log(message: str) -> None:
    print(f"[upstream] {message}", file=sys.stderr, flush=True)


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs.extend(v for k, v in attrs if k == "href" and v)


def _get(url: str, timeout: float = 60) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        raise Unreachable(f"{url}: {e}") from e


def fetch_sdist(cache: Path) -> Path:
    """vLLM's source archive in `cache`, downloaded once and sha256-checked."""
    path = cache / SDIST
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == SDIST_SHA256:
        return path
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    page = _get(f"{index}/vllm/").decode()
    parser = _Links()
    parser.feed(page)
    hrefs = [h for h in parser.hrefs if h.split("#")[0].endswith("/" + SDIST)]
    if not hrefs:
        raise SystemExit(f"{SDIST} is not listed on {index}/vllm/")
    url = urllib.request.urljoin(f"{index}/vllm/", hrefs[0].split("#")[0])
    log(f"downloading {url}")
    data = _get(url, timeout=600)
    digest = hashlib.sha256(data).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{SDIST}: sha256 {digest}, expected {SDIST_SHA256}")
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path


def unpack(sdist: Path, cache: Path) -> Path:
    """The unpacked tests/, examples/ (proxies some tests start) and
    pyproject.toml of the archive (once)."""
    root = cache / "src" / f"vllm-{VLLM_VERSION}"
    marker = root / ".unpacked-tests-examples"
    if marker.is_file():
        return root
    shutil.rmtree(root, ignore_errors=True)
    prefix = f"vllm-{VLLM_VERSION}/"
    with tarfile.open(sdist) as tar:
        wanted = tuple(
            prefix + name for name in ("pyproject.toml", "tests/", "examples/")
        )
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(cache / "src", members=members, filter="data")
    marker.touch()
    return root


def install_deps(cache: Path) -> Path:
    """The folder holding the missing test dependencies (pip --target)."""
    deps = cache / "deps"
    deps.mkdir(parents=True, exist_ok=True)
    check = (
        "import importlib.util as u, sys; "
        "print(' '.join(n for n in sys.argv[1:] if u.find_spec(n) is None))"
    )
    env = {**os.environ, "PYTHONPATH": str(deps)}
    missing = subprocess.run(
        [sys.executable, "-c", check, *TEST_DEPS],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    if missing:
        requirements = [TEST_DEPS[name] for name in missing]
        log(f"installing {' '.join(requirements)} into {deps}")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
            + ["--disable-pip-version-check", "--target", str(deps), *requirements],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            sys.stderr.write(result.stdout + result.stderr)
            raise Unreachable("pip could not install " + " ".join(requirements))
    return deps


def write_hf_configs(cache: Path) -> Path:
    """A private HF_HOME with the config.json of each model the tests name."""
    home = cache / "hf"
    configs = json.loads((SCRIPTS / "upstream_hf_configs.json").read_text())
    revision = "0" * 40
    for model, config in configs.items():
        repo = home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    return home


def check_plugin_installed() -> None:
    from importlib.metadata import entry_points

    names = {e.name for e in entry_points(group="vllm.general_plugins")}
    if PLUGIN_NAME not in names:
        raise SystemExit(f"the {PLUGIN_NAME} plugin is not installed in {sys.prefix}")


def _can_unshare_net() -> bool:
    """Whether a private network namespace can be made here (root, util-linux)."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = ["unshare", "--net", "--", "ip", "link", "set", "lo", "up"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def run_mode(
    mode: str,
    root: Path,
    deps: Path,
    hf_home: Path,
    out: Path,
    args: argparse.Namespace,
    *,
    python: str = sys.executable,
    name: str | None = None,
    targets: list[str] | None = None,
) -> tuple[str, int, float]:
    """Run pytest on `targets` (paths relative to `root`; default: the
    `args.files` of UNIT) in one mode with `python`; logs and junit files are
    named after `name` (default: the mode). Returns (name, exit status,
    seconds)."""
    name = name or mode
    env = dict(os.environ)
    for variable in ("VLLM_PLUGINS", "PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(variable, None)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_USE_V2_MODEL_RUNNER="1",
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        KV_CHECKSUM_UPSTREAM_MODE=mode,
        KV_CHECKSUM_UPSTREAM_STATS=str(out / f"hooks-{name}.json"),
        PYTHONPATH=os.pathsep.join([str(deps), str(SCRIPTS)]),
        PYTHONDONTWRITEBYTECODE="1",
    )
    if args.exact_cleanup:
        env["KV_CHECKSUM_UPSTREAM_EXACT_CLEANUP"] = "1"
    if args.package:
        env["KV_CHECKSUM_UPSTREAM_PACKAGE"] = str(args.package.resolve())
    if targets is None:
        targets = [f"{UNIT}/{f}" for f in args.files] or [UNIT]
    command = [
        python,
        "-m",
        "pytest",
        "-p",
        "kv_checksum_upstream_plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfE",
        # pytest's own traceback rendering crashed the session (an AST
        # recursion SystemError on Python 3.11) on a mooncake failure.
        "--tb=native",
        "--durations=15",
        f"--timeout={args.timeout}",
        f"--junitxml={out / f'junit-{name}.xml'}",
        "-o",
        "junit_family=xunit1",
        *targets,
    ]
    if args.netns and _can_unshare_net():
        command = [
            "unshare",
            "--net",
            "--",
            "sh",
            "-c",
            'ip link set lo up && exec "$@"',
            "sh",
            *command,
        ]
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as output:
        rc = subprocess.run(
            command, cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT
        ).returncode
    return name, rc, time.monotonic() - start


@dataclass
class Results:
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> outcome
    files: dict[str, str] = field(default_factory=dict)  # test id -> file


def read_junit(path: Path) -> Results:
    results = Results()
    if not path.is_file():
        return results
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        file = case.get("file") or (
            classname.replace(".", "/") + ".py" if classname else "(session)"
        )
        test_id = f"{classname}::{name}" if name else classname
        if case.find("failure") is not None:
            outcome = "failed"
        elif case.find("error") is not None:
            outcome = "error"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        previous = results.outcomes.get(test_id)
        if previous is None or previous == "passed":
            results.outcomes[test_id] = outcome
        results.files[test_id] = file.removeprefix(UNIT + "/")
    return results


def _counts(results: Results, file: str | None = None) -> str:
    c = Counter(
        o
        for t, o in results.outcomes.items()
        if file is None or results.files[t] == file
    )
    return f"{c['passed']} / {c['failed'] + c['error']} / {c['skipped']}"


def summarize(
    modes: list[str],
    runs: dict[str, Results],
    reference: str | None = None,
    title: str = "Tests whose result differs from the run without the plugin",
    documented: dict[tuple[str, str], str] | None = None,
) -> tuple[str, int]:
    """(Markdown summary, number of differences without a documented reason).

    Every run is compared with the `reference` run (default: ``none`` when
    present); without one, every failed test is listed. `documented` maps
    (run, test id) to the reason a difference is expected (default:
    DOCUMENTED_DIFFERENCES)."""
    if documented is None:
        documented = DOCUMENTED_DIFFERENCES
    files = sorted({f for r in runs.values() for f in r.files.values()})
    header = "| file | " + " | ".join(f"{m}: passed / failed / skipped" for m in modes)
    lines = [header + " |", "|---" * (len(modes) + 1) + "|"]
    for file in files:
        row = " | ".join(_counts(runs[m], file) for m in modes)
        lines.append(f"| {file} | {row} |")
    lines.append("| **total** | " + " | ".join(_counts(runs[m]) for m in modes) + " |")
    if reference is None and "none" in modes:
        reference = "none"
    differing: dict[str, dict[str, str]] = defaultdict(dict)
    test_ids = sorted({t for r in runs.values() for t in r.outcomes})
    for test_id in test_ids:
        outcomes = {m: runs[m].outcomes.get(test_id, "absent") for m in modes}
        if reference is None:
            if any(o in ("failed", "error") for o in outcomes.values()):
                differing[test_id] = outcomes
        elif len(set(outcomes.values())) > 1:
            differing[test_id] = outcomes
    unexplained = 0
    if reference is None:
        title = "Tests that failed"
    lines += ["", f"{title}: {len(differing)}"]
    for test_id, outcomes in differing.items():
        reasons = [
            documented[(m, test_id)] for m in modes if (m, test_id) in documented
        ]
        if not reasons:
            unexplained += 1
        shown = ", ".join(f"{m}={o}" for m, o in outcomes.items())
        why = f" (documented: {reasons[0]})" if reasons else ""
        lines.append(f"- {test_id}: {shown}{why}")
    return "\n".join(lines) + "\n", unexplained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help=f"test files relative to {UNIT}")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--jobs", type=int, default=1, help="modes run at once")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--out", type=Path, help="folder for logs and junit files")
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--no-netns", dest="netns", action="store_false")
    parser.add_argument(
        "--package",
        type=Path,
        help="import the kv_checksum package from this folder (e.g. one "
        "commit's, from git archive) instead of the editable checkout",
    )
    parser.add_argument(
        "--exact-cleanup",
        action="store_true",
        help="keep the gc.collect() of vLLM's per-test cleanup (much slower)",
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes a comma-separated subset of {MODES}")
    check_plugin_installed()
    cache: Path = args.cache
    cache.mkdir(parents=True, exist_ok=True)
    out: Path = args.out or cache / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    try:
        root = unpack(fetch_sdist(cache), cache)
        deps = install_deps(cache)
    except Unreachable as e:
        log(f"PyPI is unreachable, nothing to test against: {e}")
        return EXIT_UNREACHABLE
    hf_home = write_hf_configs(cache)
    log(f"running {', '.join(modes)} (jobs={args.jobs}); logs in {out}")
    elapsed: dict[str, float] = {}
    codes: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
        futures = [
            pool.submit(run_mode, m, root, deps, hf_home, out, args) for m in modes
        ]
        for future in concurrent.futures.as_completed(futures):
            mode, rc, seconds = future.result()
            elapsed[mode] = seconds
            codes[mode] = rc
            log(f"mode {mode}: pytest exit {rc} after {seconds:.0f} s")
    broken = [m for m, rc in codes.items() if rc not in (0, 1)]
    if broken:
        for mode in broken:
            log(f"mode {mode}: pytest did not finish normally, see {out}/{mode}.log")
        return 2
    runs = {m: read_junit(out / f"junit-{m}.xml") for m in modes}
    for mode in modes:
        if not runs[mode].outcomes:
            log(f"mode {mode} produced no results: see {out / f'{mode}.log'}")
            return 2
    summary, unexplained = summarize(modes, runs)
    times = ", ".join(f"{m} {elapsed[m]:.0f} s" for m in modes)
    package = args.package or "the editable checkout"
    summary = (
        f"vLLM {VLLM_VERSION} {UNIT}, kv_checksum package from {package}, "
        f"run times: {times}\n\n{summary}"
    )
    hooks = out / "hooks-on.json"
    if hooks.is_file():
        counts = json.loads(hooks.read_text())
        summary += (
            "\nWith checksums forced on: {schedulers} checksum schedulers and "
            "{workers} checksum workers created, {contained_errors} hook errors "
            "contained.\n".format(**counts)
        )
    (out / "summary.md").write_text(summary)
    print(summary)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
