# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The chaos runs' wrong-answer analysis (issue 27, R138 and R141: whether
answers after a recompute under process faults are wrong because of bad KV
or take a second numerics regime beside the recompute) on hand-made
outcomes."""

from pathlib import Path

from tests.v1.kv_connector.unit.kv_checksum_scripts import load_script

PATH = (
    Path(__file__).resolve().parents[4]
    / "examples/disaggregated/kv_checksum_chaos_regimes.py"
)
regimes = load_script("chaos_regimes", PATH)


def _row(rid: str, cls: str, sent: float, done: float, prompt=0, text="a"):
    return {
        "request_id": rid,
        "cls": cls,
        "sent_s": sent,
        "finished_s": done,
        "prompt": prompt,
        "text": text,
    }


def test_mismatched_ids_strip_the_engine_suffix() -> None:
    """The consumer logs the client's id plus "-<n>-<8 hex>" (bug caught: ids
    kept whole never match an outcome, so no request counts as beside a
    recompute)."""
    log = (
        "ERROR [verdict_log.py:64] KV checksum mismatch for request "
        "cmpl-x_ab-0-9c947122: group 0 block positions [1]\n"
    )
    assert regimes.mismatched_ids(log) == {"cmpl-x_ab"}


def test_overlap_counts_intervals_and_leaves_mismatched_out() -> None:
    """A wrong answer in flight while a mismatched request was is "beside";
    one before it is "alone"; the mismatched request itself is not counted
    (bug caught: an open-interval test, or the recomputing request counting
    as beside itself)."""
    rows = [
        _row("m", "right", 10.0, 11.0),
        _row("w1", "wrong", 10.5, 12.0),
        _row("w2", "wrong", 1.0, 2.0),
        _row("r1", "right", 11.0, 11.5),  # touches the end: beside
    ]
    counts = regimes.overlap_counts(rows, {"m"})
    assert counts == {
        "wrong": {"beside_recompute": 1, "alone": 1},
        "right": {"beside_recompute": 1, "alone": 0},
    }


def test_regimes_distinct_texts_and_other_runs() -> None:
    """Per prompt: wrong count and distinct wrong texts; another run's wrong
    answer counts as seen only with the same text for the same prompt (bug
    caught: matching texts across prompts)."""
    rows = [
        _row("1", "wrong", 0, 1, prompt=3, text="x"),
        _row("2", "wrong", 0, 1, prompt=3, text="x"),
        _row("3", "wrong", 0, 1, prompt=4, text="y"),
        _row("4", "right", 0, 1, prompt=4, text="z"),
    ]
    other = [
        _row("5", "wrong", 0, 1, prompt=3, text="x"),
        _row("6", "wrong", 0, 1, prompt=4, text="x"),
    ]
    result = regimes.regimes(rows, [other])
    assert result["per_prompt"] == {
        "3": {"wrong": 2, "distinct_texts": 1},
        "4": {"wrong": 1, "distinct_texts": 1},
    }
    assert result["others_wrong"] == [2] and result["others_same_text"] == [1]
