"""All-or-nothing writes (cookbook.journal): real SIGKILLs at every write, moved and copied trees,
locks, write errors, what a run refuses to touch, durability.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import sys
from pathlib import Path

from cookbook import api
from cookbook_trees import (
    APPLY_ALL, ENVS, JOURNAL, PROFILE, SCHEDULER, apply, author, cli, killed_apply,
    make_profile, make_tree, one_line_refusal, patched_reference, run, tree_hash)


def test_sigkill_mid_write_is_recovered_by_next_run(tree):
    before = tree_hash(tree)
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES="2")
    done = apply(tree, "sampler-marker", env=env)
    assert done.returncode == -signal.SIGKILL
    assert (tree / JOURNAL / "manifest.json").exists()
    assert tree_hash(tree) != before  # half written: exactly what the journal is for
    check = apply(tree, "--check", check_rc=0).stdout
    assert "recovered an interrupted run" in check and "would patch" in check
    assert not (tree / JOURNAL).exists()
    assert tree_hash(tree) == before
    apply(tree, "sampler-marker", check_rc=0)


def test_concurrent_runs_are_serialised(tree):
    procs = [subprocess.Popen([sys.executable, str(APPLY_ALL), "--profile", str(PROFILE), "--vllm-root",
                               str(tree), "--target", "vllm", "--json"], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    reports = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(r["ok"] for r in reports)
    statuses = sorted(tuple(f["status"] for f in r["fixes"]) for r in reports)
    assert statuses[-1] == ("patched",) * 3 and statuses[0] == ("already applied",) * 3
    assert sum(s == ("patched",) * 3 for s in statuses) == 1
    assert (tree / "vllm/envs.py").read_text().count("test fixture: envs marker") == 1


def test_read_only_file_is_refused_before_any_write(tree):
    target = tree / "vllm/v1/sample/sampler.py"
    target.chmod(0o444)
    before = tree_hash(tree)
    done = apply(tree, "sampler-marker", check_rc=1)
    assert "sampler.py is read-only" in done.stdout
    assert tree_hash(tree) == before


def test_sigkill_after_every_write_recovers_the_old_tree(tree):
    """The fixture series with the opt-in writes 4 files (3 sources + the stamp)."""
    before = tree_hash(tree)
    for writes in range(1, 5):
        env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES=str(writes))
        killed = cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", "sampler-marker", env=env)
        assert killed.returncode == -9, (writes, killed.stdout)
        recovery = run(PROFILE, tree, mode="check")
        assert recovery.ok and len(recovery.recovered) == 4
        assert tree_hash(tree) == before, f"after a kill at write {writes}"
        assert not list((tree / "vllm").glob(".cookbook-fixes-journal*"))


def test_kill_inside_a_new_file_write_leaves_no_temp_file(tree):
    before = tree_hash(tree)
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES="1")
    assert cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", env=env).returncode == -9
    # The state a kill between open(tmp) and os.replace leaves: the journal, a partial temp, no stamp.
    stamp = tree / "vllm/cookbook-fixes.json"
    partial = stamp.read_bytes()[:10]
    stamp.unlink()
    (tree / "vllm/.cookbook-fixes.json.cookbook-tmp").write_bytes(partial)
    assert run(PROFILE, tree, mode="check").ok
    assert not list(tree.rglob("*.cookbook-tmp"))
    assert tree_hash(tree) == before


def test_half_written_journal_is_discarded(tree):
    """A crash while journalling leaves only the staging directory (no manifest, nothing changed)."""
    before = tree_hash(tree)
    staging = tree / "vllm/.cookbook-fixes-journal.tmp-4242"
    staging.mkdir()
    (staging / "0").write_bytes((tree / ENVS).read_bytes()[:100])
    report = run(PROFILE, tree, mode="check")
    assert report.ok and report.recovered == []
    assert tree_hash(tree) == before  # the staging directory is gone, nothing else touched


def test_concurrent_apply_and_revert_end_in_a_whole_state(tree, tmp_path):
    pristine = tree_hash(tree)
    patched_tree = make_tree(tree, tmp_path / "reference")
    run(PROFILE, patched_tree)
    patched = tree_hash(patched_tree)
    for first_state in ("pristine", "patched"):
        procs = [subprocess.Popen([sys.executable, str(APPLY_ALL), "--profile", str(PROFILE),
                                   "--vllm-root", str(tree), "--target", "vllm", *mode],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for mode in ([], ["--revert"])]
        for proc in procs:
            proc.communicate(timeout=120)
        assert [p.returncode for p in procs] == [0, 0], first_state
        assert tree_hash(tree) in (pristine, patched)
        assert not list((tree / "vllm").glob(".cookbook-fixes-journal*"))


def test_root_given_as_a_symlink(tree, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tree)
    out = json.loads(cli("--profile", PROFILE, "--vllm-root", link, "--target", "vllm", "--json").stdout)
    assert out["ok"] and out["targets"]["vllm"]["root"] == str(tree)
    assert link.is_symlink() and (tree / "vllm/cookbook-fixes.json").exists()
    assert "test fixture: envs marker" in (tree / ENVS).read_text()


def test_package_directory_symlinked_inside_the_root(tree, tmp_path):
    """Editable-style layouts: <root>/vllm is a symlink; the files behind it are patched in place."""
    real = tmp_path / "real-vllm"
    shutil.move(tree / "vllm", real)
    (tree / "vllm").symlink_to(real)
    assert run(PROFILE, tree).ok
    assert (tree / "vllm").is_symlink() and "test fixture: envs marker" in (real / "envs.py").read_text()


def test_read_only_directory_as_root_user_or_refused(tree):
    """Root ignores directory permissions; anyone else must get a refusal before any write."""
    sample_dir = tree / "vllm/v1/sample"
    sample_dir.chmod(0o555)
    try:
        before = tree_hash(tree)
        report = run(PROFILE, tree, ["sampler-marker"])
        if os.geteuid() == 0:
            assert report.ok
        else:
            assert report.exit_code == 1 and "not writable" in report.error and tree_hash(tree) == before
    finally:
        sample_dir.chmod(0o755)


def test_recovery_after_the_tree_was_moved_restores_the_moved_tree(vllm_src, tree, tmp_path):
    before = tree_hash(tree)
    killed_apply(tree, 1)
    moved = tmp_path / "moved"
    shutil.move(tree, moved)
    check = apply(moved, "--check", check_rc=0)
    assert "recovered an interrupted run" in check.stdout
    assert tree_hash(moved) == before  # restored where it is now
    assert not tree.exists()  # nothing written under the old path
    apply(moved, check_rc=0)
    assert tree_hash(moved) == patched_reference(vllm_src, tmp_path)
    assert apply(moved, "--revert", check_rc=0) and tree_hash(moved) == before


def test_recovery_of_a_copied_tree_touches_only_the_copy(tree, tmp_path):
    before = tree_hash(tree)
    killed_apply(tree, 2)
    copy = tmp_path / "copy"
    shutil.copytree(tree, copy, symlinks=True)
    half_done = tree_hash(tree)
    assert "recovered an interrupted run" in apply(copy, "--check", check_rc=0).stdout
    assert tree_hash(copy) == before
    assert tree_hash(tree) == half_done  # the original keeps its own journal ...
    apply(tree, "--check", check_rc=0)
    assert tree_hash(tree) == before  # ... and is restored by a run on it


def test_journal_naming_a_path_outside_its_tree_is_refused(tree, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tree / JOURNAL).mkdir()
    (tree / JOURNAL / "0").write_text("planted\n")
    (tree / JOURNAL / "manifest.json").write_text(json.dumps(
        {"run": "x", "files": [{"path": "../../victim.txt", "backup": "0", "mode": 0o644}]}))
    one_line_refusal(apply(tree), 1, "../../victim.txt", "not a path inside")
    assert victim.read_text() == "keep me\n" and (tree / JOURNAL).is_dir()


def test_directory_where_a_fix_creates_a_file(tree, tmp_path):
    patch = author(tree, lambda w: (w / "vllm" / "new_module.py").write_text("z = 1\n"), tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"creates": patch}, ["creates"])
    (tree / "vllm" / "new_module.py").mkdir()
    before = tree_hash(tree)
    one_line_refusal(apply(tree, profile=profile), 1, "new_module.py", "is a directory")
    assert tree_hash(tree) == before


def test_file_named_like_the_journal_is_refused(tree):
    (tree / JOURNAL).write_text("not ours\n")
    before = tree_hash(tree)
    one_line_refusal(apply(tree), 1, JOURNAL, "not a directory")
    assert tree_hash(tree) == before


def test_write_error_during_the_commit_restores_and_says_so(tree):
    # The last file's temporary name is taken by a directory: its write fails after the stamp and
    # envs.py were written (a real error from the file system, not an injected one).
    obstacle = tree / SCHEDULER
    obstacle = obstacle.with_name(f".{obstacle.name}.cookbook-tmp")
    obstacle.mkdir()
    before = tree_hash(tree)
    line = one_line_refusal(apply(tree), 1, "failed", "restored")
    assert "Is a directory" in line
    assert tree_hash(tree) == before and not (tree / JOURNAL).exists()


def test_journal_without_manifest_is_left_and_named(tree):
    (tree / JOURNAL).mkdir()
    (tree / JOURNAL / "0").write_text("someone's bytes\n")
    for mode in ([], ["--check"]):
        one_line_refusal(apply(tree, *mode), 1, JOURNAL, "manifest")
        assert (tree / JOURNAL / "0").read_text() == "someone's bytes\n"


def test_scratch_of_a_killed_run_is_removed_by_the_next(tree, tmp_path):
    scratch_tmp = tmp_path / "tmp"
    scratch_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch_tmp), COOKBOOK_TEST_KILL_AFTER_WRITES="1")
    assert apply(tree, env=env).returncode == -signal.SIGKILL
    left = list(scratch_tmp.glob("cookbook-scratch-*"))
    assert left
    for folder in left:  # a minute old: not one a live run has just made and not yet locked
        os.utime(folder, (time.time() - 120, time.time() - 120))
    env.pop("COOKBOOK_TEST_KILL_AFTER_WRITES")
    apply(tree, env=env, check_rc=0)
    assert not list(scratch_tmp.glob("cookbook-scratch-*"))


def test_journal_and_written_files_reach_the_disk(tree, monkeypatch):
    """Durability on power loss: the journal's folder is fsynced once it has its name (and before
    any file is written), each written file before it replaces the old one."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                  real_fsync(fd))[1])
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(b))), real_rename(a, b))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b))[1])
    api.run(api.load_profile(str(PROFILE)), {"vllm": tree, "vllm-gaudi": None}, [], only_targets=["vllm"])
    named = events.index(("rename", str(tree / JOURNAL)))
    assert events[named + 1] == ("fsync", str(tree / "vllm"))
    first_write = next(i for i, e in enumerate(events) if e[0] == "replace")
    assert named < first_write
    for i, (kind, path) in enumerate(events):
        if kind == "replace":
            assert events[i - 1] == ("fsync", str(Path(path).with_name(f".{Path(path).name}.cookbook-tmp")))
    last_write = max(i for i, e in enumerate(events) if e[0] == "replace")
    discarded = next(i for i, e in enumerate(events) if e[0] == "rename" and ".done-" in e[1])
    synced = {path for kind, path in events[last_write:discarded] if kind == "fsync"}
    assert {str(tree / "vllm"), str(tree / "vllm/v1/core/sched")} <= synced  # the folders written to


def _second_path(tree: Path, tmp_path: Path) -> Path:
    """Another root whose vllm/ is a symbolic link to the tree's: one package, two paths."""
    other = tmp_path / "other-root"
    other.mkdir()
    (other / "vllm").symlink_to(tree / "vllm")
    return other


def test_concurrent_runs_through_two_paths_to_one_package_end_whole(vllm_src, tree, tmp_path):
    """Apply, revert and check, through both paths at once, several rounds: one lock and one journal
    for the package, so it always ends fully applied or pristine and every run exits 0."""
    import random
    other = _second_path(tree, tmp_path)
    pristine, patched = tree_hash(tree), patched_reference(vllm_src, tmp_path)
    rng = random.Random(24)
    for round_ in range(12):
        runs = [(rng.choice([tree, other]), rng.choice([[], ["--revert"], ["--check"]])) for _ in range(7)]
        procs = [subprocess.Popen([sys.executable, str(APPLY_ALL), "--profile", str(PROFILE), "--vllm-root",
                                   str(root), "--target", "vllm", *mode], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for root, mode in runs]
        outs = [p.communicate(timeout=180) for p in procs]
        assert [p.returncode for p in procs] == [0] * 7, (round_, runs, outs)
        assert tree_hash(tree) in (pristine, patched), (round_, runs)
        assert not list((tree / "vllm").glob(".cookbook-fixes-journal*"))
        assert not list(tmp_path.glob("*/.cookbook-fixes-journal*"))


def test_run_killed_through_one_path_is_recovered_through_the_other(tree, tmp_path):
    other = _second_path(tree, tmp_path)
    before = tree_hash(tree)
    for killed_via, recovered_via in ((other, tree), (tree, other)):
        killed_apply(killed_via, 2)  # the journal is in the package, whichever path wrote it
        check = apply(recovered_via, "--check", check_rc=0)
        assert "recovered an interrupted run" in check.stdout
        assert tree_hash(tree) == before and not (tree / JOURNAL).exists()


def test_journal_of_the_earlier_layout_is_restored(tree):
    """Journals used to live beside the package (<root>/.cookbook-fixes-journal, paths relative to
    the root): a run left by an earlier version of the fix pack is still undone."""
    before = tree_hash(tree)
    killed_apply(tree, 2)
    legacy = tree / ".cookbook-fixes-journal"
    shutil.move(tree / JOURNAL, legacy)
    manifest = json.loads((legacy / "manifest.json").read_text())
    for entry in manifest["files"]:
        entry["path"] = "vllm/" + entry["path"]
    (legacy / "manifest.json").write_text(json.dumps(manifest))
    assert "recovered an interrupted run" in apply(tree, "--check", check_rc=0).stdout
    assert tree_hash(tree) == before and not legacy.exists()
