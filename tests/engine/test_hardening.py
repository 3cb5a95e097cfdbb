"""Hardening of the fix-pack engine, on real vLLM v0.30.0 files and real disks: symlinks, moved
trees, unreadable checkouts, file modes and owners, paths git quotes, clean refusals, leftovers.

Crashes are real: the entry point runs in a child process that SIGKILLs itself after N file writes
(COOKBOOK_TEST_KILL_AFTER_WRITES), then the next real run must put things right.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook import api
from test_apply import PROFILE, apply, make_tree, tree_hash
from test_edge_cases import author, make_profile, replace

JOURNAL = ".cookbook-fixes-journal"
STAMP = "vllm/cookbook-fixes.json"
ENVS = "vllm/envs.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
OTHER_USER = 54321  # no such user here: git's ownership check then refuses the checkout


@pytest.fixture
def tree(vllm_src, tmp_path) -> Path:
    return make_tree(vllm_src, tmp_path / "tree")


def killed_apply(root: Path, after_writes: int, *extra) -> None:
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES=str(after_writes))
    done = apply(root, *extra, env=env)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    assert (root / JOURNAL / "manifest.json").exists()


def one_line_refusal(done: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The run refused with `code` in one REFUSED/error line naming `words`, and no traceback."""
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    assert "Traceback" not in out, out
    line = next(l for l in out.splitlines() if l.startswith(("REFUSED", "error:")))
    for word in words:
        assert word in line, line
    return line


def patched_reference(vllm_src, tmp_path) -> str:
    """The hash of a fresh tree after a clean apply of the fixture profile."""
    ref = make_tree(vllm_src, tmp_path / "reference")
    apply(ref, check_rc=0)
    return tree_hash(ref)


# ----------------------------------------------------------------------------- 1. symlinks

def test_patch_creating_a_symlink_is_refused_and_nothing_is_written(tree, tmp_path):
    def link(work: Path):
        os.symlink("/etc/hostname", work / "vllm" / "x")
        replace(ENVS, b"import os\n", b"import os  # with a link\n")(work)
    profile = make_profile(tmp_path / "p", {"linker": author(tree, link, tmp_path / "w")}, ["linker"])
    before = tree_hash(tree)
    done = apply(tree, profile=profile)
    one_line_refusal(done, 1, "vllm/x", "symbolic link")
    assert tree_hash(tree) == before and not os.path.lexists(tree / "vllm" / "x")
    assert apply(tree, "--revert", profile=profile).returncode == 1  # refused the same way, not broken


def test_patch_through_a_symlink_in_the_tree_is_refused(tree, tmp_path):
    profile = make_profile(tmp_path / "p", {"edit": author(tree, replace(ENVS, b"import os\n", b"import os  # e\n"),
                                                           tmp_path / "w")}, ["edit"])
    real = tree / "vllm" / "envs_real.py"
    (tree / ENVS).rename(real)
    os.symlink("envs_real.py", tree / ENVS)  # inside the package, but still a link
    before = tree_hash(tree)
    one_line_refusal(apply(tree, profile=profile), 1, "symbolic link")
    assert tree_hash(tree) == before and (tree / ENVS).is_symlink()


# ----------------------------------------------------------------------------- 2. moved trees

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
        {"run": "x", "files": [{"path": "../victim.txt", "backup": "0", "mode": 0o644}]}))
    one_line_refusal(apply(tree), 1, "../victim.txt", "not a path inside")
    assert victim.read_text() == "keep me\n" and (tree / JOURNAL).is_dir()


# ----------------------------------------------------------------------------- 3. unreadable checkouts

def _commit_checkout(root: Path) -> str:
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "another commit"], check=True)
    return subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the checkout to another user")
def test_checkout_owned_by_another_user_is_identified_not_skipped(tree):
    # _version.py names the pin; the checkout says otherwise. Git refuses to read a checkout owned
    # by someone else ("dubious ownership"): that must not fall back to _version.py.
    head = _commit_checkout(tree)
    for path in [tree, *tree.rglob("*")]:
        os.lchown(path, OTHER_USER, OTHER_USER)
    before = tree_hash(tree)
    one_line_refusal(apply(tree), 2, "expected commit ced6857a", head[:12])
    assert tree_hash(tree) == before


def test_checkout_git_cannot_read_stops_identification(tree):
    _commit_checkout(tree)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/nowhere\n")  # unborn branch: no HEAD commit
    before = tree_hash(tree)
    line = one_line_refusal(apply(tree), 2, "cannot identify", "git cannot read its HEAD")
    assert "_version.py" not in line.split("found", 1)[-1].split(";")[0]
    assert tree_hash(tree) == before


# ----------------------------------------------------------------------------- 4. modes and owners

def test_file_modes_and_owners_are_kept_through_apply_and_revert(tree):
    modes = {ENVS: 0o600, SCHEDULER: 0o664}
    for rel, mode in modes.items():
        os.chmod(tree / rel, mode)
    if os.geteuid() == 0:
        os.chown(tree / SCHEDULER, OTHER_USER, OTHER_USER)
    before = tree_hash(tree)  # modes are part of the hash
    apply(tree, check_rc=0)
    for rel, mode in modes.items():
        assert (tree / rel).stat().st_mode & 0o7777 == mode, rel
    if os.geteuid() == 0:
        assert (tree / SCHEDULER).stat().st_uid == OTHER_USER
    apply(tree, "--revert", check_rc=0)
    assert tree_hash(tree) == before


def test_mode_change_of_a_patch_is_applied_to_the_files_own_bits(tree, tmp_path):
    def executable(work: Path):
        os.chmod(work / SCHEDULER, 0o755)
    profile = make_profile(tmp_path / "p", {"exec": author(tree, executable, tmp_path / "w")}, ["exec"])
    os.chmod(tree / SCHEDULER, 0o640)
    apply(tree, profile=profile, check_rc=0)
    assert (tree / SCHEDULER).stat().st_mode & 0o7777 == 0o750  # x where r was, nothing more
    apply(tree, "--revert", profile=profile, check_rc=0)
    assert (tree / SCHEDULER).stat().st_mode & 0o7777 == 0o640


# ----------------------------------------------------------------------------- 5. paths git quotes

def test_paths_with_spaces_and_quoted_names(tree, tmp_path):
    def names(work: Path):
        (work / "vllm" / "a spaced name.py").write_text("x = 1\n")  # first file of the patch
        (work / "vllm" / "t\u00e9st.py").write_text("y = 2\n")  # git quotes it: "b/vllm/t\303\251st.py"
        replace(ENVS, b"import os\n", b"import os  # names\n")(work)
    patch = author(tree, names, tmp_path / "w")
    assert b'"b/vllm/t\\303\\251st.py"' in patch and b"b/vllm/a spaced name.py" in patch
    profile = make_profile(tmp_path / "p", {"names": patch}, ["names"])
    before = tree_hash(tree)
    done = apply(tree, "--json", profile=profile, check_rc=0)
    files = json.loads(done.stdout)["fixes"][0]["files"]
    assert files == ["vllm/a spaced name.py", ENVS, "vllm/t\u00e9st.py"]
    assert (tree / "vllm" / "a spaced name.py").read_text() == "x = 1\n"
    assert (tree / "vllm" / "t\u00e9st.py").read_text() == "y = 2\n"
    apply(tree, "--revert", profile=profile, check_rc=0)
    assert tree_hash(tree) == before


def test_refusal_names_the_spaced_file_that_differs(tree, tmp_path):
    (tree / "vllm" / "z spaced.py").write_text("a = 1\n")
    patch = author(tree, lambda w: (replace(ENVS, b"import os\n", b"import os  # s\n")(w),
                                    (w / "vllm" / "z spaced.py").write_text("a = 2\n")), tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"spaced": patch}, ["spaced"])
    (tree / "vllm" / "z spaced.py").write_text("a = 3\n")  # edited: the second file no longer matches
    before = tree_hash(tree)
    one_line_refusal(apply(tree, profile=profile), 1, "spaced", "hunk @@ -1,1 +1,1 @@ does not match vllm/z spaced.py")
    assert tree_hash(tree) == before


# ----------------------------------------------------------------------------- 6. clean refusals

@pytest.mark.parametrize("stamp", ["[]", '{"fixes": 5}', '{"profiles": 5}',
                                   '{"profiles": {"engine-fixture": {"fixes": 5}}}', "{not json"])
def test_malformed_stamp_is_one_refusal_line(tree, stamp):
    (tree / STAMP).write_text(stamp)
    before = tree_hash(tree)
    one_line_refusal(apply(tree), 1, STAMP, "not a fix-pack stamp")
    as_json = apply(tree, "--json")
    assert as_json.returncode == 1 and not json.loads(as_json.stdout)["ok"]
    assert tree_hash(tree) == before


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


# ----------------------------------------------------------------------------- 7. smaller points

def test_root_without_the_package_is_a_base_mismatch(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line_refusal(apply(tmp_path / "empty"), 2, "no vllm/ package directory")


def test_usage_error_with_json_prints_a_json_object(tree):
    done = apply(tree, "--json", "--no-such-option")
    assert done.returncode == 3
    answer = json.loads(done.stdout)
    assert answer["ok"] is False and answer["exit_code"] == 3 and "--no-such-option" in answer["error"]


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
    assert list(scratch_tmp.glob("cookbook-scratch-*"))
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
    assert events[named + 1] == ("fsync", str(tree))
    first_write = next(i for i, e in enumerate(events) if e[0] == "replace")
    assert named < first_write
    for i, (kind, path) in enumerate(events):
        if kind == "replace":
            assert events[i - 1] == ("fsync", str(Path(path).with_name(f".{Path(path).name}.cookbook-tmp")))
