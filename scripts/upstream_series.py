# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Apply the in-tree patch series (upstream/*.patch) to vLLM 0.33.0 and test it.

Called by scripts/upstream_series.sh with the project's virtualenv Python; see
upstream/README.md. Steps of ``check`` (the default):

1. Fetch vLLM 0.33.0's source archive (scripts/upstream_tests.py's fetch,
   sha256-checked) into the cache shared with scripts/upstream_tests.sh.
2. Commit the archive's whole source as ``vLLM 0.33.0`` (tag vllm-0.33.0) in
   a scratch git repository under CACHE/tree (once), outside the clone, and
   apply the first N patches of the series there with ``git am``.
3. Build the patched vLLM without a second build: CACHE/overlay/vllm holds
   hard links to the virtualenv's installed vllm package (Python files and
   built .so files) with the files the series adds or changes written over
   them (each changed file is first checked to be the archive's unchanged
   file). CACHE/env is a separate virtualenv of the same Python whose only
   site-packages entry is a .pth naming the overlay, then the project
   virtualenv's site-packages: vLLM's other dependencies come from there, but
   the project's editable install of the plugin package (a .pth import hook)
   is not run, so the plugin's modules are not importable there.
4. Run vLLM's own tests (default tests/v1/kv_connector/unit and tests/v1/core)
   with the patched tree, and compare them test by test with the same tests
   of the unpatched archive run with the project's virtualenv (that run is
   cached per target list: ``--rebaseline`` repeats it). Both runs hide the
   plugin's entry point (scripts/kv_checksum_upstream_plugin.py, mode
   ``none``) and use upstream_tests.py's dependencies, HF configs, junit
   parsing and comparison.
5. Once the series defines the native configuration fields, load this
   checkout's plugin into the patched environment and check that it sees the
   native subsystem and installs nothing.

``--each`` checks the prefixes one commit at a time (bisectability): each
commit applies, and the vLLM test files it adds or changes pass with it.
``tree`` prints the scratch tree with the series applied (to edit a commit);
``export`` writes the tree's commits back to upstream/ with git format-patch.

Exit status: 0 all checks passed, 1 a check failed (a patch does not apply,
a test differs without a documented reason, a commit's own tests fail, the
plugin installed something), 2 set-up error, 3 PyPI unreachable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections import Counter
from pathlib import Path

import upstream_tests as ut

REPO = ut.SCRIPTS.parent
SERIES = REPO / "upstream"
BASE_TAG = f"vllm-{ut.VLLM_VERSION}"
DEFAULT_TARGETS = ("tests/v1/kv_connector/unit", "tests/v1/core")
PLUGIN_PACKAGE = "vllm.distributed.kv_transfer.kv_checksum"
NATIVE_FIELD = "enable_kv_checksum"
# Sources the overlay cannot take: they need vLLM's build.
COMPILED_SUFFIXES = (".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".rs")
# Who commits in the scratch tree (git am keeps each patch's author).
GIT_COMMITTER = {
    "GIT_COMMITTER_NAME": "upstream_series.py",
    "GIT_COMMITTER_EMAIL": "upstream-series@localhost",
}
# The base commit is the same on every machine: fixed author and dates.
BASE_IDENTITY = {
    "GIT_AUTHOR_NAME": "vLLM source archive",
    "GIT_AUTHOR_EMAIL": "upstream-series@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
}

# Tests whose result on the patched tree may differ from the unpatched
# archive, and why. Keys: test ids as upstream_tests.read_junit names them.
# Tests the series adds are expected to be absent from the unpatched run and
# need no entry.
SERIES_DIFFERENCES: dict[str, str] = {}


class CheckFailed(Exception):
    """A check of the series failed (exit status 1)."""


def log(message: str) -> None:
    print(f"[series] {message}", file=sys.stderr, flush=True)


def git(
    tree: Path,
    *args: str,
    env: dict[str, str] | None = None,
    ok: tuple[int, ...] = (0,),
) -> str:
    """git's output in `tree`; an exit status outside `ok` is a failed check
    (`git grep` exits 1 when nothing matches)."""
    environment = {**os.environ, **GIT_COMMITTER, **(env or {})}
    result = subprocess.run(
        ["git", "-c", "core.autocrlf=false", "-c", "gc.auto=0", *args],
        cwd=tree,
        env=environment,
        capture_output=True,
    )
    if result.returncode not in ok:
        raise CheckFailed(
            f"git {' '.join(args)} failed in {tree}:\n"
            + result.stdout.decode(errors="replace")
            + result.stderr.decode(errors="replace")
        )
    return result.stdout.decode(errors="replace")


def git_bytes(tree: Path, revision: str, path: str) -> bytes:
    return subprocess.run(
        ["git", "show", f"{revision}:{path}"],
        cwd=tree,
        capture_output=True,
        check=True,
    ).stdout


def patches() -> list[Path]:
    return sorted(SERIES.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def base_tree(sdist: Path, cache: Path) -> Path:
    """The scratch repository holding the archive's source as its base commit."""
    tree = cache / "tree"
    if (tree / ".git").is_dir():
        try:
            git(tree, "rev-parse", "-q", "--verify", f"refs/tags/{BASE_TAG}")
            return tree
        except CheckFailed:
            pass
    log(f"committing the source of {sdist.name} to {tree}")
    shutil.rmtree(tree, ignore_errors=True)
    unpacked = cache / "unpack"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    (unpacked / f"vllm-{ut.VLLM_VERSION}").rename(tree)
    shutil.rmtree(unpacked)
    git(tree, "init", "-q", "-b", "main")
    # -f: the archive's own .gitignore must not drop any of its files.
    git(tree, "add", "-A", "-f")
    message = f"vLLM {ut.VLLM_VERSION}\n\nThe source archive {sdist.name} from PyPI."
    git(tree, "commit", "-q", "-m", message, env=BASE_IDENTITY)
    git(tree, "tag", BASE_TAG)
    return tree


def apply_series(tree: Path, upto: int) -> list[str]:
    """Check out the base, apply the first `upto` patches; their commits.
    Refuses to run over uncommitted edits in the tree (they would be lost)."""
    if git(tree, "status", "--porcelain", "--untracked-files=normal").strip():
        raise CheckFailed(
            f"{tree} has uncommitted changes: commit them (and export) first"
        )
    git(tree, "checkout", "-q", "-f", "--detach", BASE_TAG)
    git(tree, "clean", "-q", "-f", "-d", "-x")
    for patch in patches()[:upto]:
        try:
            git(tree, "am", "-q", "--keep-non-patch", str(patch))
        except CheckFailed as e:
            subprocess.run(["git", "am", "--abort"], cwd=tree, capture_output=True)
            raise CheckFailed(f"{patch.name} does not apply: {e}") from e
    commits = git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
    assert len(commits) == upto, (commits, upto)
    return commits


def changed_files(tree: Path, old: str, new: str) -> list[tuple[str, str]]:
    """(status, path) of the files `new` changes against `old` (no renames)."""
    out = git(tree, "diff", "--name-status", "--no-renames", old, new)
    return [tuple(line.split("\t", 1)) for line in out.splitlines()]  # type: ignore[misc]


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def build_overlay(tree: Path, cache: Path) -> Path:
    """CACHE/overlay holding the installed vllm package with the series' files."""
    installed = site_packages() / "vllm"
    overlay = cache / "overlay"
    manifest_path = overlay / "manifest.json"
    manifest = {}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
    if manifest.get("installed") != str(installed) or not (overlay / "vllm").is_dir():
        shutil.rmtree(overlay, ignore_errors=True)
        overlay.mkdir(parents=True)
        log(f"linking {installed} into {overlay}")
        shutil.copytree(installed, overlay / "vllm", copy_function=os.link)
        manifest = {"installed": str(installed), "written": []}
    # Restore what the previous prefix wrote: links to the installed files.
    for relative in manifest["written"]:
        target = overlay / relative
        target.unlink(missing_ok=True)
        source = installed.parent / relative
        if source.is_file():
            os.link(source, target)
    manifest["written"] = []
    manifest_path.write_text(json.dumps(manifest))
    for status, path in changed_files(tree, BASE_TAG, "HEAD"):
        if not path.startswith("vllm/"):
            if path.endswith(COMPILED_SUFFIXES) or path.startswith(("csrc/", "cmake")):
                raise CheckFailed(f"the series changes {path}: it needs vLLM's build")
            continue
        if path.endswith(COMPILED_SUFFIXES):
            raise CheckFailed(f"the series changes {path}: it needs vLLM's build")
        target = overlay / path
        if status != "A":
            base = git_bytes(tree, BASE_TAG, path)
            source = installed.parent / path
            if not source.is_file() or source.read_bytes() != base:
                raise CheckFailed(
                    f"{source} is not the archive's {path}: the patched file "
                    "cannot be laid over this installation"
                )
        manifest["written"].append(path)
        # Unlink first: the overlay's files are hard links to the virtualenv's.
        target.unlink(missing_ok=True)
        for cached in target.parent.glob(f"__pycache__/{target.stem}.*.pyc"):
            cached.unlink()
        if status != "D":
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(git_bytes(tree, "HEAD", path))
    manifest_path.write_text(json.dumps(manifest))
    return overlay


def build_env(cache: Path, overlay: Path) -> Path:
    """CACHE/env: a virtualenv seeing the overlay first, then the project's
    site-packages without running its .pth import hooks (the editable install
    of the plugin package) except the ones that are not the plugin's."""
    env = cache / "env"
    python = env / "bin" / "python"
    if not python.exists():
        log(f"creating {env}")
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(env)], check=True
        )
    purelib = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    target = Path(purelib)
    for old in target.glob("*.pth"):
        old.unlink()
    project = site_packages()
    (target / "00-upstream-series.pth").write_text(f"{overlay}\n{project}\n")
    for pth in project.glob("*.pth"):
        if not pth.name.startswith("__editable__"):
            shutil.copy(pth, target / pth.name)
    return python


PROBE = """
import dataclasses, importlib.util, json, sys
import vllm
from vllm.config import KVTransferConfig

try:
    plugin_visible = importlib.util.find_spec(%(package)r + ".plugin") is not None
except ModuleNotFoundError:
    plugin_visible = False
found = {"vllm": vllm.__file__, "version": vllm.__version__,
         "plugin_visible": plugin_visible,
         "native": %(field)r in {f.name for f in dataclasses.fields(KVTransferConfig)}}
if found["native"]:
    # Load this checkout's plugin package as the editable install would.
    root, name = %(root)r, %(package)r
    spec = importlib.util.spec_from_file_location(
        name, root + "/__init__.py", submodule_search_locations=[root])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    from vllm.distributed.kv_transfer.kv_checksum import plugin
    plugin.register()
    wiring = sys.modules.get(name + ".wiring")
    found["installed"] = bool(getattr(wiring, "_installed", False))
print(json.dumps(found))
"""


def probe_env(python: Path, overlay: Path) -> str:
    """The environment imports vLLM from the overlay and never the plugin; once
    the series defines the native fields, this checkout's plugin loaded into
    it installs nothing (R146). Returns what was found about the plugin."""
    code = PROBE % {
        "field": NATIVE_FIELD,
        "root": str(REPO / PLUGIN_PACKAGE.replace(".", "/")),
        "package": PLUGIN_PACKAGE,
    }
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    if out.returncode != 0:
        raise CheckFailed(
            f"the patched environment probe failed:\n{out.stderr[-4000:]}"
        )
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(found["vllm"]).is_relative_to(overlay):
        raise CheckFailed(f"the patched environment imports {found['vllm']}")
    if found["plugin_visible"]:
        raise CheckFailed("the plugin's modules are importable in the patched env")
    log(f"patched environment: vllm {found['version']} from {found['vllm']}")
    if not found["native"]:
        return "the series does not define the native fields yet: plugin not probed"
    if found["installed"]:
        raise CheckFailed("the plugin installed its hooks into the patched vLLM")
    return "the plugin sees the native subsystem and installs nothing"


def export_tests(tree: Path, dest: Path) -> Path:
    """tests/, examples/ and pyproject.toml of the tree's HEAD in `dest`: a
    test root without vllm/, so the installed (overlay) package is imported."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "archive", "HEAD", "tests", "examples", "pyproject.toml"],
        cwd=tree,
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_options(args: argparse.Namespace) -> argparse.Namespace:
    """The options upstream_tests.run_mode reads."""
    return argparse.Namespace(
        timeout=args.timeout,
        netns=args.netns,
        exact_cleanup=False,
        package=None,
        files=[],
    )


def run_tests(
    name: str,
    python: str,
    root: Path,
    targets: list[str],
    out: Path,
    setup: tuple[Path, Path],
    args: argparse.Namespace,
) -> ut.Results:
    deps, hf_home = setup
    log(f"{name}: pytest {' '.join(targets)}")
    name, rc, seconds = ut.run_mode(
        "none",
        root,
        deps,
        hf_home,
        out,
        run_options(args),
        python=python,
        name=name,
        targets=targets,
    )
    log(f"{name}: pytest exit {rc} after {seconds:.0f} s (log {out / name}.log)")
    if rc not in (0, 1):
        raise CheckFailed(f"{name}: pytest did not finish normally (exit {rc})")
    results = ut.read_junit(out / f"junit-{name}.xml")
    if not results.outcomes:
        raise CheckFailed(f"{name}: no results, see {out / name}.log")
    (out / f"seconds-{name}.txt").write_text(f"{seconds:.0f}\n")
    return results


def baseline(
    root: Path,
    targets: list[str],
    cache: Path,
    setup: tuple[Path, Path],
    args: argparse.Namespace,
) -> tuple[ut.Results, str]:
    """The unpatched archive's results for `targets` (those it has: the
    series may add test files), run once and cached."""
    targets = [t for t in targets if (root / t.split("::")[0]).exists()]
    if not targets:
        return ut.Results(), "unpatched: none of the tests exist"
    key = hashlib.sha256(
        json.dumps([targets, str(site_packages()), args.timeout]).encode()
    ).hexdigest()[:16]
    folder = cache / "baseline" / key
    junit = folder / "junit-unpatched.xml"
    # The seconds file is written last: a run killed before it left junit
    # but no seconds, and is run again.
    done = folder / "seconds-unpatched.txt"
    if junit.is_file() and done.is_file() and not args.rebaseline:
        seconds = done.read_text().strip()
        return ut.read_junit(junit), f"unpatched {seconds} s (cached in {folder})"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    results = run_tests("unpatched", sys.executable, root, targets, folder, setup, args)
    seconds = (folder / "seconds-unpatched.txt").read_text().strip()
    return results, f"unpatched {seconds} s"


def compare(unpatched: ut.Results, patched: ut.Results) -> tuple[str, int]:
    """The per-file table and the differences from the unpatched run; the
    tests the series adds are counted apart (their failures are differences)."""
    added = {t for t in patched.outcomes if t not in unpatched.outcomes}
    added_ok = {t for t in added if patched.outcomes[t] in ("passed", "skipped")}
    kept = ut.Results(
        {t: o for t, o in patched.outcomes.items() if t not in added_ok},
        {t: f for t, f in patched.files.items() if t not in added_ok},
    )
    table, unexplained = ut.summarize(
        ["unpatched", "patched"],
        {"unpatched": unpatched, "patched": kept},
        reference="unpatched",
        title="Tests whose result differs from the unpatched run",
        documented={("patched", t): r for t, r in SERIES_DIFFERENCES.items()},
    )
    counts = Counter(patched.outcomes[t] for t in added)
    files = sorted({patched.files[t] for t in added})
    table += (
        f"\nTests the series adds: {len(added)} ({counts['passed']} passed, "
        f"{counts['failed'] + counts['error']} failed, {counts['skipped']} "
        f"skipped) in {', '.join(files) or 'no file'}; the table above counts "
        "only the failed ones.\n"
    )
    return table, unexplained


def _is_test_file(path: str) -> bool:
    return re.fullmatch(r"test_.*\.py", Path(path).name) is not None


def commit_test_files(tree: Path, commit: str) -> list[str]:
    """The tests of the files a commit touches: the vLLM test files it adds or
    changes, and the test files under DEFAULT_TARGETS that import a vLLM
    module it changes (by its dotted name)."""
    files = set()
    for status, path in changed_files(tree, f"{commit}^", commit):
        if status == "D":
            continue
        if path.startswith("tests/") and _is_test_file(path):
            files.add(path)
        elif path.startswith("vllm/") and path.endswith(".py"):
            module = path.removesuffix(".py").removesuffix("/__init__")
            found = git(
                tree,
                "grep",
                "-l",
                "-F",
                "-e",
                module.replace("/", "."),
                commit,
                "--",
                *DEFAULT_TARGETS,
                ok=(0, 1),
            )
            files.update(
                line.split(":", 1)[1]
                for line in found.splitlines()
                if _is_test_file(line.split(":", 1)[1])
            )
    return sorted(files)


def prepare(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(sdist cache, series cache, the sdist)."""
    cache: Path = args.cache
    sdist_cache: Path = args.sdist_cache or cache.parent / "upstream"
    cache.mkdir(parents=True, exist_ok=True)
    sdist_cache.mkdir(parents=True, exist_ok=True)
    return sdist_cache, cache, ut.fetch_sdist(sdist_cache)


def check_each(args: argparse.Namespace, tree: Path, cache: Path, out: Path) -> int:
    """Each prefix of the series applies, and the tests of the files its last
    commit touches fail nowhere the unpatched archive passes."""
    setup = (ut.install_deps(args.sdist_cache), ut.write_hf_configs(args.sdist_cache))
    commits = apply_series(tree, args.upto)
    first = args.each_from
    commits_checked = commits[first - 1 :]
    files = {c: commit_test_files(tree, c) for c in commits_checked}
    union = sorted({f for fs in files.values() for f in fs})
    sdist = ut.fetch_sdist(args.sdist_cache)
    unpatched, _ = baseline(
        ut.unpack(sdist, args.sdist_cache), union, cache, setup, args
    )
    failing = {t for t, o in unpatched.outcomes.items() if o in ("failed", "error")}
    failed = 0
    lines = []
    for k, patch in enumerate(patches()[: args.upto], start=1):
        if k < first:
            continue
        start = time.monotonic()
        apply_series(tree, k)
        overlay = build_overlay(tree, cache)
        python = build_env(cache, overlay)
        plugin = probe_env(python, overlay)
        verdict = "applies"
        targets = files[commits[k - 1]]
        if targets:
            root = export_tests(tree, cache / "src")
            results = run_tests(
                f"each-{k:04d}", str(python), root, targets, out, setup, args
            )
            bad = sorted(
                t
                for t, o in results.outcomes.items()
                if o in ("failed", "error") and t not in failing
            )
            verdict += (
                f"; {len(targets)} test files: {ut._counts(results)} "
                "(passed / failed / skipped)"
            )
            if bad:
                failed += 1
                verdict += "; FAILED where unpatched passes: " + ", ".join(bad)
            elif any(o in ("failed", "error") for o in results.outcomes.values()):
                verdict += ", each failure failing unpatched too"
        seconds = time.monotonic() - start
        lines.append(f"- {patch.name}: {verdict}; {plugin} ({seconds:.0f} s)")
        log(lines[-1])
    summary = "Each commit of the series on its own:\n\n" + "\n".join(lines) + "\n"
    (out / "summary-each.md").write_text(summary)
    print(summary)
    return 1 if failed else 0


def check(args: argparse.Namespace) -> int:
    sdist_cache, cache, sdist = prepare(args)
    args.sdist_cache = sdist_cache
    total = len(patches())
    if args.upto is None:
        args.upto = total
    if not 0 <= args.upto <= total:
        raise SystemExit(f"--upto takes 0 to {total}")
    out: Path = args.out or cache / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    tree = base_tree(sdist, cache)
    if args.each:
        return check_each(args, tree, cache, out)
    started = time.monotonic()
    if args.keep_tree:
        commits = git(tree, "rev-list", "--reverse", f"{BASE_TAG}..HEAD").split()
        log(f"testing the tree's HEAD as it is ({len(commits)} commits)")
    else:
        commits = apply_series(tree, args.upto)
        log(f"applied {len(commits)} of {total} patches")
    overlay = build_overlay(tree, cache)
    python = build_env(cache, overlay)
    plugin = probe_env(python, overlay)
    log(plugin)
    setup_seconds = time.monotonic() - started
    if args.no_tests:
        return 0
    targets = args.targets or list(DEFAULT_TARGETS)
    setup = (ut.install_deps(sdist_cache), ut.write_hf_configs(sdist_cache))
    native: list[str] = []
    native_ok = True
    if args.upto == total and not args.keep_tree:
        report, native_ok = subsystem_in_step(tree)
        native.append(report)
    if args.project:
        for run in (run_project, run_demo):
            report, ok = run(python, setup[0], out)
            native.append(report)
            native_ok = native_ok and ok
        if args.project_only:
            summary = "\n\n".join([f"plugin: {plugin}", *native])
            (out / "summary.md").write_text(summary + "\n")
            print(summary)
            return 0 if native_ok else 1
    unpatched, unpatched_time = baseline(
        ut.unpack(sdist, sdist_cache), targets, cache, setup, args
    )
    patched = run_tests(
        "patched",
        str(python),
        export_tests(tree, cache / "src"),
        targets,
        out,
        setup,
        args,
    )
    patched_time = (out / "seconds-patched.txt").read_text().strip()
    table, unexplained = compare(unpatched, patched)
    applied = (
        f"the scratch tree's HEAD ({len(commits)} commits)"
        if args.keep_tree
        else f"patches 1-{args.upto} of {total} "
        f"({', '.join(p.name for p in patches()[: args.upto]) or 'none'})"
    )
    summary = (
        f"vLLM {ut.VLLM_VERSION} with {applied}\n"
        f"targets: {' '.join(targets)}; set-up {setup_seconds:.0f} s, "
        f"{unpatched_time}, patched {patched_time} s\n"
        f"plugin: {plugin}\n\n{table}"
    )
    summary = "\n\n".join([summary, *native])
    (out / "summary.md").write_text(summary)
    print(summary)
    return 1 if unexplained or not native_ok else 0


SUBSYSTEM = Path(*PLUGIN_PACKAGE.split("."))
# The one subsystem file whose text may differ: the package docstring names the
# plugin in the checkout and the config field in vLLM's tree.
SUBSYSTEM_OWN_TEXT = ("__init__.py",)


def subsystem_in_step(tree: Path) -> tuple[str, bool]:
    """With the whole series applied, every file the series puts under
    kv_checksum/ is this checkout's file byte for byte (the plugin and the
    series share one subsystem; only the plugin's own files are absent from
    the tree). Returns (report, in step)."""
    listed = git(tree, "ls-files", "--", str(SUBSYSTEM)).split()
    drifted = sorted(
        str(Path(f).relative_to(SUBSYSTEM))
        for f in listed
        if str(Path(f).relative_to(SUBSYSTEM)) not in SUBSYSTEM_OWN_TEXT
        and (
            not (REPO / f).is_file()
            or (REPO / f).read_bytes() != (tree / f).read_bytes()
        )
    )
    head = (
        f"the series' {len(listed)} files under {SUBSYSTEM}/ against this "
        f"checkout's package: {len(drifted)} differ"
    )
    log(head)
    return "\n".join([head, *(f"- DIFFERS {f}" for f in drifted)]), not drifted


PROJECT_TESTS = "tests/v1/kv_connector/unit"
DEMO = "examples/disaggregated/kv_checksum_pd_demo.py"


def native_env(deps: Path) -> dict[str, str]:
    """The environment of this project's own runs in the patched vLLM: its
    virtualenv sees the overlay first and never the plugin."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_PLUGINS", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONPATH")
    }
    # As scripts/test.sh runs the suite: no vLLM variables of its own (the
    # harness picks the scheduler and model runner per test).
    env.update(PYTHONPATH=str(deps), PYTHONDONTWRITEBYTECODE="1")
    return env


def run_project(python: Path, deps: Path, out: Path) -> tuple[str, bool]:
    """(b) This checkout's test suite against the patched vLLM: the plugin is
    not importable there, test files that need its wiring (or a capability
    the series has not reached) are not collected, and every collected test
    must pass or skip. Returns (report, passed)."""
    log(f"project: pytest {PROJECT_TESTS} against the patched vLLM")
    junit = out / "junit-project.xml"
    started = time.monotonic()
    with open(out / "project.log", "w") as stream:
        rc = subprocess.call(
            [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
             PROJECT_TESTS, f"--junitxml={junit}"],
            cwd=REPO, env=native_env(deps), stdout=stream, stderr=subprocess.STDOUT,
        )  # fmt: skip
    seconds = time.monotonic() - started
    results = ut.read_junit(junit)
    counts = Counter(results.outcomes.values())
    text = (out / "project.log").read_text()
    left_out = text.split("not collected on the native subsystem", 1)[-1]
    left_out_files = re.findall(r"^(test_\w+\.py): needs (\S+)", left_out, re.M)
    failed = sorted(t for t, o in results.outcomes.items() if o in ("failed", "error"))
    lines = [
        f"this project's {PROJECT_TESTS} against the patched vLLM: "
        f"{counts['passed']} passed, {len(failed)} failed, {counts['skipped']} "
        f"skipped in {seconds:.0f} s (pytest exit {rc}); "
        f"{len(left_out_files)} files not collected:",
        *(f"- {name}: needs {module}" for name, module in left_out_files),
        *(f"- FAILED {test}" for test in failed),
    ]
    log(f"project: {lines[0]}")
    return "\n".join(lines), rc == 0 and not failed and bool(results.outcomes)


def run_demo(python: Path, deps: Path, out: Path) -> tuple[str, bool]:
    """(c) The CPU demo against the patched vLLM: every injected fault must be
    detected (the demo's own exit status)."""
    log(f"demo: {DEMO} against the patched vLLM")
    result = subprocess.run(
        [str(python), DEMO], cwd=REPO, env=native_env(deps),
        capture_output=True, text=True,
    )  # fmt: skip
    (out / "demo.log").write_text(result.stdout + result.stderr)
    last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    log(f"demo: exit {result.returncode}: {last}")
    return f"the CPU demo against the patched vLLM: exit {result.returncode}, {last}", (
        result.returncode == 0
    )


def tree_command(args: argparse.Namespace) -> int:
    _, cache, sdist = prepare(args)
    tree = base_tree(sdist, cache)
    upto = len(patches()) if args.upto is None else args.upto
    apply_series(tree, upto)
    git(tree, "checkout", "-q", "-B", "series")
    print(tree)
    return 0


def files_command(args: argparse.Namespace) -> int:
    """The vLLM files the series adds or changes, as patched, under
    OUT/vllm/ (for a GPU host: `scripts/gpu_runs.sh install-series`)."""
    _, cache, sdist = prepare(args)
    tree = base_tree(sdist, cache)
    upto = len(patches()) if args.upto is None else args.upto
    apply_series(tree, upto)
    dest: Path = args.out or REPO / "gpu_series"
    shutil.rmtree(dest, ignore_errors=True)
    for status, path in changed_files(tree, BASE_TAG, "HEAD"):
        if path.startswith("vllm/") and status != "D":
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(git_bytes(tree, "HEAD", path))
    print(dest)
    return 0


def export_command(args: argparse.Namespace) -> int:
    cache: Path = args.cache
    tree = cache / "tree"
    commits = git(tree, "rev-list", f"{BASE_TAG}..HEAD").split()
    if not commits:
        raise SystemExit(f"{tree} has no commits after {BASE_TAG}")
    for old in patches():
        old.unlink()
    SERIES.mkdir(exist_ok=True)
    git(
        tree,
        "format-patch",
        "-q",
        "--zero-commit",
        "--no-signature",
        "-o",
        str(SERIES),
        f"{BASE_TAG}..HEAD",
    )
    for patch in patches():
        print(patch.relative_to(REPO))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "command",
        nargs="?",
        default="check",
        choices=("check", "tree", "export", "files"),
    )
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument(
        "--sdist-cache", type=Path, help="default: CACHE/../upstream (shared)"
    )
    parser.add_argument("--upto", type=int, help="apply the first N patches only")
    parser.add_argument(
        "--each", action="store_true", help="check every prefix up to --upto"
    )
    parser.add_argument(
        "--from",
        dest="each_from",
        type=int,
        default=1,
        help="with --each: start at this commit (the earlier ones still apply)",
    )
    parser.add_argument(
        "--tests",
        dest="targets",
        action="append",
        help="a vLLM test path (repeatable; default: "
        + ", ".join(DEFAULT_TARGETS)
        + ")",
    )
    parser.add_argument("--no-tests", action="store_true")
    parser.add_argument(
        "--keep-tree",
        action="store_true",
        help="test the scratch tree's committed HEAD as it is (after "
        "editing it; see the tree command) instead of applying upstream/",
    )
    parser.add_argument(
        "--no-project",
        dest="project",
        action="store_false",
        help="skip (b) this project's suite and (c) the demo on the patched vLLM",
    )
    parser.add_argument(
        "--project-only",
        action="store_true",
        help="run (b) and (c) only, not vLLM's own tests",
    )
    parser.add_argument("--rebaseline", action="store_true")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--out", type=Path, help="folder for logs and junit files")
    parser.add_argument("--no-netns", dest="netns", action="store_false")
    args = parser.parse_args()
    commands = {
        "check": check,
        "tree": tree_command,
        "export": export_command,
        "files": files_command,
    }
    try:
        return commands[args.command](args)
    except CheckFailed as e:
        log(f"FAILED: {e}")
        return 1
    except ut.Unreachable as e:
        log(f"PyPI is unreachable, nothing to test against: {e}")
        return ut.EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
