"""One run over vLLM and vllm-gaudi in two different trees: all or nothing across both."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from cookbook_trees import APPLY_ALL, FIXTURES, make_tree, tree_hash

PROFILE = FIXTURES / "profile-two-trees.yaml"


@pytest.fixture
def trees(vllm_src, vllm_gaudi_src, tmp_path):
    vllm = make_tree(vllm_src, tmp_path / "vllm-tree")
    gaudi = tmp_path / "gaudi-tree"
    (gaudi / "vllm_gaudi").mkdir(parents=True)
    shutil.copy2(vllm_gaudi_src / "vllm_gaudi/__init__.py", gaudi / "vllm_gaudi/__init__.py")
    # The archive of 091bbadd carries no commit record: make it the checkout it came from.
    git = ["git", "-C", str(gaudi), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    return vllm, gaudi


def run(vllm, gaudi, *extra, env=None):
    return subprocess.run([sys.executable, str(APPLY_ALL), "verify" if "verify" in extra else "apply",
                           "--profile", str(PROFILE), "--vllm-root", str(vllm), "--vllm-gaudi-root", str(gaudi),
                           *[e for e in extra if e != "verify"]], capture_output=True, text=True, env=env, timeout=120)


def test_failure_in_one_tree_leaves_both_unchanged(trees):
    vllm, gaudi = trees
    (vllm / "vllm/v1/core/sched/scheduler.py").write_text("edited\n")
    before = tree_hash(vllm), tree_hash(gaudi)
    done = run(vllm, gaudi)
    # Pins are checked first: the gaudi tree is an untagged fresh checkout, so it is refused.
    assert done.returncode == 2 and "vllm-gaudi: expected commit 091bbadd" in done.stdout
    assert (tree_hash(vllm), tree_hash(gaudi)) == before
    verify = run(vllm, gaudi, "verify")
    assert verify.returncode == 1 and "scheduler-marker" in verify.stdout
    assert (tree_hash(vllm), tree_hash(gaudi)) == before


def test_sigkill_across_two_trees_is_recovered(trees):
    vllm, gaudi = trees
    before = tree_hash(vllm), tree_hash(gaudi)
    # The library in process (the pin is not checked: the gaudi tree is a fresh checkout).
    code = ("from cookbook import series; from cookbook.profiles import load_profile; from pathlib import Path; "
            "p = load_profile(%r); "
            "series.run(p, {'vllm': Path(%r), 'vllm-gaudi': Path(%r)}, [], check_pin=False)"
            % (str(PROFILE), str(vllm), str(gaudi)))
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES="2")
    killed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120,
                            cwd=APPLY_ALL.parents[1])
    assert killed.returncode == -signal.SIGKILL
    assert (tree_hash(vllm), tree_hash(gaudi)) != before
    # Each tree holds its own journal (paths relative to it) with the run's id. A run on one
    # tree alone restores it and, through the shared run id, the other tree too.
    for tree in (vllm, gaudi):
        assert (tree / ".cookbook-fixes-journal" / "manifest.json").exists()
    secondary = gaudi
    target = "vllm-gaudi"
    done = subprocess.run([sys.executable, str(APPLY_ALL), "--profile", str(PROFILE), "--target", target,
                           f"--{target}-root", str(secondary), "--check"], capture_output=True, text=True)
    assert "recovered an interrupted run" in done.stdout
    assert (tree_hash(vllm), tree_hash(gaudi)) == before
    assert not (vllm / ".cookbook-fixes-journal").exists()
    assert not (gaudi / ".cookbook-fixes-journal").exists()
