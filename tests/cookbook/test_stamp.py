"""The stamp (cookbook.stamp): what it records across apply, revert and re-apply; malformed stamps.
"""
from __future__ import annotations

import hashlib
import json

import pytest

from cookbook_trees import (
    BASE, PROFILE, REPO, STAMP, apply, one_line_refusal, run, stamped, tree_hash)


def test_stamp_after_apply_revert_reapply(tree):
    before = tree_hash(tree)
    run(PROFILE, tree, ["sampler-marker"])
    stamp = json.loads((tree / "vllm/cookbook-fixes.json").read_text())["profiles"]["engine-fixture"]
    assert stamp["commit_found"] == "ced6857af" and stamp["pin"] == BASE
    for fix in stamp["fixes"]:
        patch = REPO / fix["patches"][0]["file"]
        assert hashlib.sha256(patch.read_bytes()).hexdigest() == fix["patches"][0]["sha256"]
    run(PROFILE, tree, ["sampler-marker"], mode="revert")
    assert stamped(tree) is None and tree_hash(tree) == before
    run(PROFILE, tree, ["sampler-marker"])
    assert stamped(tree) == ["envs-marker", "scheduler-marker", "envs-second-marker", "sampler-marker"]


def test_stamp_keeps_an_applied_opt_in(tree):
    """The stamp describes the tree: a run keeps the opt-ins it records (and --revert removes them)."""
    before = tree_hash(tree)
    run(PROFILE, tree, ["sampler-marker"])
    report = run(PROFILE, tree)  # a later default run (e.g. a rebuild) that does not name it
    assert [f.status for f in report.fixes][-1] == "already applied"
    assert "cookbook test fixture" in (tree / "vllm/v1/sample/sampler.py").read_text()
    assert "sampler-marker" in stamped(tree)
    reverted = run(PROFILE, tree, mode="revert")
    assert [f.status for f in reverted.fixes] == ["reverted"] * 4
    assert stamped(tree) is None and tree_hash(tree) == before


@pytest.mark.parametrize("stamp", ["[]", '{"fixes": 5}', '{"profiles": 5}',
                                   '{"profiles": {"engine-fixture": {"fixes": 5}}}', "{not json"])
def test_malformed_stamp_is_one_refusal_line(tree, stamp):
    (tree / STAMP).write_text(stamp)
    before = tree_hash(tree)
    one_line_refusal(apply(tree), 1, STAMP, "not a fix-pack stamp")
    as_json = apply(tree, "--json")
    assert as_json.returncode == 1 and not json.loads(as_json.stdout)["ok"]
    assert tree_hash(tree) == before
