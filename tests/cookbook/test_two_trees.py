"""One run over vLLM and vllm-gaudi in two different trees: all or nothing across both."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import json

from cookbook_trees import APPLY_ALL, FIXTURES, JOURNAL, make_tree, tree_hash

JOURNAL_NAME = Path(JOURNAL).name

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


def journals(vllm, gaudi):
    """Each package keeps its journal in its own directory."""
    return [vllm / JOURNAL, gaudi / "vllm_gaudi" / JOURNAL_NAME]


def library_run(vllm, gaudi, mode="apply", targets=("vllm", "vllm-gaudi"), kill_after=None):
    """series.run in a process of its own (the pin is not checked: the gaudi tree is a fresh
    checkout); with kill_after, SIGKILLed after that many steps of its commit."""
    roots = {"vllm": str(vllm), "vllm-gaudi": str(gaudi)}
    code = ("import json, sys; from cookbook import series; from cookbook.profiles import load_profile; "
            "from pathlib import Path; p = load_profile(%r); "
            "r = series.run(p, {t: Path(d) for t, d in %r.items()}, [], mode=%r, check_pin=False); "
            "print(json.dumps({'ok': r.ok, 'error': r.error, 'recovered': r.recovered, "
            "'finished': r.finished, 'written': r.written}))"
            % (str(PROFILE), {t: roots[t] for t in targets}, mode))
    env = dict(os.environ)
    if kill_after:
        env["COOKBOOK_TEST_KILL_AFTER_WRITES"] = str(kill_after)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd=APPLY_ALL.parents[1])


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
    for journal in journals(vllm, gaudi):
        assert (journal / "manifest.json").exists()
    secondary = gaudi
    target = "vllm-gaudi"
    done = subprocess.run([sys.executable, str(APPLY_ALL), "--profile", str(PROFILE), "--target", target,
                           f"--{target}-root", str(secondary), "--check"], capture_output=True, text=True)
    assert "recovered an interrupted run" in done.stdout
    assert (tree_hash(vllm), tree_hash(gaudi)) == before
    assert not any(j.exists() for j in journals(vllm, gaudi))


def test_kill_at_each_step_of_the_commit_leaves_both_trees_on_one_side(trees):
    """Kill the run after each step from its last file write through its journal discards (the
    commit markers, then the discards), then run on one tree alone: both trees end pristine or
    both end patched, whichever tree the next run touches, and the other tree's next run agrees."""
    vllm, gaudi = trees
    pristine = tree_hash(vllm), tree_hash(gaudi)
    clean = library_run(vllm, gaudi)  # in place: the stamp names the checkout's path
    assert clean.returncode == 0 and json.loads(clean.stdout)["ok"], clean.stderr
    writes = len(json.loads(clean.stdout)["written"])
    patched = tree_hash(vllm), tree_hash(gaudi)
    assert json.loads(library_run(vllm, gaudi, mode="revert").stdout)["ok"]
    assert (tree_hash(vllm), tree_hash(gaudi)) == pristine
    # steps: the file writes, one marker per journal (the commit point), one discard per journal
    for kill_after in range(writes, writes + 4):
        for first, second in (("vllm", "vllm-gaudi"), ("vllm-gaudi", "vllm")):
            killed = library_run(vllm, gaudi, kill_after=kill_after)
            assert killed.returncode == -signal.SIGKILL, (kill_after, killed.stderr)
            committed = kill_after > writes
            after_first = library_run(vllm, gaudi, mode="check", targets=(first,))
            assert after_first.returncode == 0, after_first.stderr
            # the files, leaving out a journal the tree not yet run on may still hold
            both = tree_hash(vllm, skip=JOURNAL_NAME), tree_hash(gaudi, skip=JOURNAL_NAME)
            assert both == (patched if committed else pristine), (kill_after, first)
            assert library_run(vllm, gaudi, mode="check", targets=(second,)).returncode == 0
            assert (tree_hash(vllm), tree_hash(gaudi)) == both, (kill_after, second)
            assert not any(j.exists() for j in journals(vllm, gaudi)), (kill_after, first)
            if committed:  # back to pristine for the next kill
                reverted = library_run(vllm, gaudi, mode="revert")
                assert json.loads(reverted.stdout)["ok"], reverted.stdout
            assert (tree_hash(vllm), tree_hash(gaudi)) == pristine


def test_finishing_a_run_marks_the_journal_of_a_tree_another_process_holds(trees):
    """Killed after the first commit marker; the next run on the marked tree finds the other tree
    locked by another process: it leaves that tree's journal marked as committed, so the lock's
    holder finishes the run too instead of restoring its tree."""
    import fcntl
    vllm, gaudi = trees
    clean = library_run(vllm, gaudi)
    writes = len(json.loads(clean.stdout)["written"])
    patched = tree_hash(vllm), tree_hash(gaudi)
    assert json.loads(library_run(vllm, gaudi, mode="revert").stdout)["ok"]
    assert library_run(vllm, gaudi, kill_after=writes + 1).returncode == -signal.SIGKILL
    marked = [j for j in journals(vllm, gaudi) if (j / "committed").exists()]
    assert len(marked) == 1
    marked_target = "vllm" if marked[0].parent.name == "vllm" else "vllm-gaudi"
    other_target = {"vllm": "vllm-gaudi", "vllm-gaudi": "vllm"}[marked_target]
    other_package = vllm / "vllm" if other_target == "vllm" else gaudi / "vllm_gaudi"
    fd = os.open(other_package, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # "another process" holds the other tree
        done = library_run(vllm, gaudi, mode="check", targets=(marked_target,))
        assert json.loads(done.stdout)["finished"], done.stdout
        assert (other_package / JOURNAL_NAME / "committed").exists()
    finally:
        os.close(fd)
    done = library_run(vllm, gaudi, mode="check", targets=(other_target,))
    assert json.loads(done.stdout)["finished"] == [str(other_package.resolve())]
    assert (tree_hash(vllm), tree_hash(gaudi)) == patched
