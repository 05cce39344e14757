# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The benchmarks' trials (issue 30, R142: measuring a switch's cost): a named
switch of the package set in one engine's processes only, so one benchmark
compares the trial with the default pair by pair (`--trial`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script
from tests.v1.kv_connector.unit.test_kv_checksum_bench_prefix_hits import (
    _fake_setup,
    _free_port,
    _rejudge,
    _rounds,
    _write_summaries,
    bench,
)

ROOT = Path(__file__).resolve().parents[4]
TRIAL_SITE = ROOT / "benchmarks/host/trial_site"
trials = load_script(
    "kv_checksum_trials", ROOT / "benchmarks/host/kv_checksum_trials.py"
)

SWITCHES = """
import vllm.distributed.kv_transfer.kv_checksum.wiring.offloading as offloading
import vllm.distributed.kv_transfer.kv_checksum.wiring.simple_cpu_offload as simple
print("switches", offloading.SAVE_STORES_WITH_LOADS, simple.HOLD_COPY_HAND_OFFS)
"""


def _switches(tmp_path: Path, trial: str | None) -> tuple[str, str]:
    """The two switches as a fresh interpreter sees them with the trial site
    first on its path and `trial` named, and what the next sitecustomize on
    the path wrote (it stands for the hook timer's)."""
    after = tmp_path / "after_site"
    after.mkdir(exist_ok=True)
    mark = tmp_path / "mark"
    (after / "sitecustomize.py").write_text(
        f"open({str(mark)!r}, 'w').write('next sitecustomize ran')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TRIAL_SITE), str(after)]))
    env.pop("KV_CHECKSUM_TRIAL", None)
    if trial is not None:
        env["KV_CHECKSUM_TRIAL"] = trial
    out = subprocess.run(
        [sys.executable, "-c", SWITCHES],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("switches"))
    return line, mark.read_text() if mark.exists() else ""


def test_trial_site_sets_the_named_switches_and_keeps_the_next_site(
    tmp_path: Path,
) -> None:
    """R142 (measuring a switch's host cost): the trial site sets both named
    switches after their modules' own assignments (they read False / True
    without a trial), and still runs the next sitecustomize on the path.
    Bugs caught: the switch set before its module ran (the module's own line
    undoes it), the site swallowing the hook timer's sitecustomize, a trial
    leaking into a process that names none."""
    default, mark = _switches(tmp_path, None)
    assert default == "switches False True"
    assert mark == "next sitecustomize ran"
    trial, mark = _switches(tmp_path, "early-saves,no-hold")
    assert trial == "switches True False"
    assert mark == "next sitecustomize ran"


def test_a_switch_its_module_lacks_fails_loudly(tmp_path: Path) -> None:
    """R142: a trial whose switch was renamed raises at import instead of running
    the default under the trial's name; an unknown trial name is refused.
    Bug caught: `setattr` creating the missing name (the run would measure the
    default and call it the trial)."""
    (tmp_path / "trial_target_mod.py").write_text("KEPT = 1\n")
    finder = trials._SetAfterImport([trials.Trial("trial_target_mod", "GONE", 2)])
    sys.path.insert(0, str(tmp_path))
    sys.meta_path.insert(0, finder)
    try:
        with pytest.raises(AttributeError, match="no switch GONE"):
            __import__("trial_target_mod")
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("trial_target_mod", None)
        sys.path.remove(str(tmp_path))
    with pytest.raises(ValueError, match="unknown trials"):
        trials.parse("early-saves,bogus")
    assert trials.parse("") == []


def test_trial_run_turns_checksums_on_in_both_slots(tmp_path: Path) -> None:
    """R142: `--trial`: both engines get the checksum config, only the "on" engine
    the trial (its processes log it), and the record names the trial so the
    pairs read trial / default. Bugs caught: the "off" slot left without
    checksums (then the run measures checksums, not the switch), the trial
    reaching both slots, and `--trial` with `--control` accepted."""
    assert bench.configured_mode("off", False, "no-hold") == "on"
    assert bench.configured_mode("on", True, None) == "off"
    assert bench.trial_env("off", "no-hold", "/x") == {}
    on_env = bench.trial_env("on", "no-hold", "/x")
    assert on_env["KV_CHECKSUM_TRIAL"] == "no-hold"
    assert on_env["PYTHONPATH"].split(os.pathsep) == [str(TRIAL_SITE), "/x"]
    model, fake, out = _fake_setup(tmp_path)
    argv = ["--out", str(out), "--model", str(model), "--tier", "simple-offload"]
    argv += ["--scale", "0.02", "--serve-cmd", fake, "--bench-cmd", fake]
    argv += ["--startup-timeout", "120", "--trial", "no-hold"]
    argv += ["--port-off", str(_free_port()), "--port-on", str(_free_port())]
    rc = bench.main(argv)
    record = json.loads((out / "summary.json").read_text())
    configs = record["config"]["transfer_config"]
    assert configs["on"] == configs["off"]
    assert "kv_checksum" in json.dumps(configs["off"])
    assert record["config"]["trial"] == "no-hold"
    assert "default vs trial no-hold" in record["config"]["title"]
    logs = out / "launch0"
    assert "[kv_checksum_trials]" in (logs / "on.log").read_text()
    assert "[kv_checksum_trials]" not in (logs / "off.log").read_text()
    assert rc == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(out), "--trial", "no-hold", "--control"])


def test_rejudge_never_pools_a_trial_with_an_on_off_run(tmp_path: Path) -> None:
    """R142: a trial's "on/off" is trial / default: `--pool` refuses to mix it with
    checksum on/off runs. Bug caught: pooling them into one meaningless ratio."""
    rounds = _rounds([10.0, 9.0, 9.0, 10.0], [30, 31, 31, 30], [{}, {}])
    paths = _write_summaries(
        tmp_path,
        {"config": {"tier": "simple-offload"}, "rounds": rounds},
        {"config": {"tier": "simple-offload", "trial": "no-hold"}, "rounds": rounds},
    )
    mixed = _rejudge("--pool", *paths, check=False)
    assert mixed.returncode != 0 and "different trials" in mixed.stderr


@pytest.mark.parametrize("name", sorted(trials.TRIALS))
def test_every_trial_edits_exactly_its_switch_in_a_site_copy(
    name: str, tmp_path: Path
) -> None:
    """R142, issue 30: each named trial, run as `gpu_runs.sh trial-NAME` does
    (the trials table's `--site` edit of the machine's package copy), changes
    exactly its switch's line, from this tree's default to another value.
    Bugs caught: a switch renamed or moved in the package while the trial
    still names the old one (the machine would run the default under the
    trial's name); a trial whose value is the default; an edit touching
    another line."""
    import importlib

    from tests.v1.kv_connector.unit.kv_checksum_helpers import (
        assert_trial_edits_one_line,
    )

    module = importlib.import_module(trials.TRIALS[name].module)
    assert_trial_edits_one_line(name, module, tmp_path)


def test_a_site_edit_of_a_missing_switch_fails_loudly(tmp_path: Path) -> None:
    """R142: the site edit refuses a file with no (or two) assignments of the
    switch instead of leaving it unchanged. Bug caught: a `sed` that matches
    nothing and exits 0 (the trial measures the default)."""
    trial = trials.TRIALS["no-hold"]
    path = tmp_path / (trial.module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True)
    path.write_text("OTHER = 1\n")
    with pytest.raises(ValueError, match="0 assignments of HOLD_COPY_HAND_OFFS"):
        trials.edit_site(tmp_path, "no-hold")
    path.write_text("HOLD_COPY_HAND_OFFS = True\nHOLD_COPY_HAND_OFFS = True\n")
    with pytest.raises(ValueError, match="2 assignments"):
        trials.edit_site(tmp_path, "no-hold")
    assert path.read_text().count("= True") == 2
