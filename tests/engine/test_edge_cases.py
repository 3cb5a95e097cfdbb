"""Adversarial edge cases for the fix-pack engine, on real vLLM v0.30.0 files.

Every patch here is authored the way docs/fix-format.md says (a scratch git repository of real
files, `git diff --full-index`), at test time, so no upstream file is committed. Known bugs are
`xfail(strict=True)`: each turns into a failure (XPASS) the moment it is fixed, so the marker
has to be dropped with the fix.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook import api
from cookbook.errors import CookbookError
from test_apply import make_tree, tree_hash  # the same real files, the same tree fingerprint

REPO = Path(__file__).resolve().parents[2]
APPLY_ALL = REPO / "fixes" / "apply_all.py"
FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_PROFILE = FIXTURES / "profile.yaml"
BASE = "ced6857afa0ea7b2e3f0846a62e1394e90f15607"
ENVS = "vllm/envs.py"  # mode 0755 in the sdist, like in vLLM's repository


# ----------------------------------------------------------------------------- helpers

def _git(repo: Path, *args) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           "-c", "core.autocrlf=false", *args], check=True, capture_output=True).stdout


def author(base: Path, edit, work: Path) -> bytes:
    """The patch `edit(copy of base)` makes, as `git diff --full-index` (renames detected)."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(base, work, symlinks=True)
    _git(work, "init", "-q")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "base")
    edit(work)
    _git(work, "add", "-A")
    patch = _git(work, "diff", "--cached", "--full-index", "-M")
    shutil.rmtree(work)
    return patch


def replace(rel: str, old: bytes, new: bytes):
    def edit(work: Path):
        data = (work / rel).read_bytes()
        assert old in data, f"{old!r} not in {rel}"
        (work / rel).write_bytes(data.replace(old, new, 1))
    return edit


def fix_yaml(name: str, extra: str = "", patches: str | None = None) -> str:
    if patches is None:
        patches = f"patches:\n  - target: vllm\n    file: vllm.patch\n    base: {BASE}\n"
    return f"title: {name}\ntargets: [vllm]\n{patches}upstream:\n  status: inappropriate\n{extra}"


def make_profile(where: Path, fixes: dict[str, bytes], order: list[str], opt_in=(), metas=None,
                 extra: str = "") -> Path:
    """A profile extending v0.30.0 with its own fixes folder; `metas` adds fix.yaml lines."""
    fixes_dir = where / "fixes"
    fixes_dir.mkdir(parents=True)
    for name, patch in fixes.items():
        (fixes_dir / name).mkdir()
        (fixes_dir / name / "vllm.patch").write_bytes(patch)
        (fixes_dir / name / "fix.yaml").write_text(fix_yaml(name, (metas or {}).get(name, "")))
    profile = where / "profile.yaml"
    profile.write_text(f"name: edge\nextends: v0.30.0\nfixes-dir: fixes\nfixes: {json.dumps(order)}\n"
                       f"opt-in: {json.dumps(list(opt_in))}\n{extra}")
    return profile


def run(profile: Path, root: Path, opt_ins=(), mode="apply", strict=False):
    """The library's run, in process (fast); returns the report."""
    report = api.run(api.load_profile(str(profile)), {"vllm": root, "vllm-gaudi": None}, list(opt_ins), mode=mode,
                        only_targets=["vllm"], strict=strict)
    return report


def statuses(report) -> list[tuple[str, str]]:
    return [(f.name, f.status) for f in report.fixes]


def cli(*args, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APPLY_ALL), *map(str, args)], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def tree(vllm_src, tmp_path) -> Path:
    return make_tree(vllm_src, tmp_path / "tree")


@pytest.fixture
def overlapping(tree, tmp_path):
    """Two fixes authored in series on envs.py: B rewrites a line that is context of A's hunk."""
    a = author(tree, replace(ENVS, b"import logging\nimport os\n", b"import logging\n# fix A\nimport os\n"),
               tmp_path / "wa")
    mid = make_tree(tree, tmp_path / "mid")
    (tmp_path / "a.patch").write_bytes(a)
    subprocess.run(["git", "apply", str(tmp_path / "a.patch")], cwd=mid, check=True)
    b = author(mid, replace(ENVS, b"import os\n", b"import os  # fix B\n"), tmp_path / "wb")
    return make_profile(tmp_path / "p", {"fix-a": a, "fix-b": b}, ["fix-a", "fix-b"])


# ----------------------------------------------------------------------------- series semantics

def test_overlapping_series_rerun_is_already_applied(tree, overlapping):
    assert statuses(run(overlapping, tree)) == [("fix-a", "patched"), ("fix-b", "patched")]
    again = run(overlapping, tree)
    assert again.ok, again.error
    assert statuses(again) == [("fix-a", "already applied"), ("fix-b", "already applied")]


def test_overlapping_series_revert_when_not_applied(tree, overlapping):
    report = run(overlapping, tree, mode="revert")
    assert report.ok, report.error
    assert statuses(report) == [("fix-a", "not applied"), ("fix-b", "not applied")]


def test_overlapping_series_by_context_rerun(tree, overlapping):
    envs = tree / ENVS
    envs.write_bytes(envs.read_bytes() + b"# a local edit far from the hunks\n")
    assert run(overlapping, tree).ok
    again = run(overlapping, tree)
    assert again.ok, again.error
    assert statuses(again) == [("fix-a", "already applied"), ("fix-b", "already applied")]


def test_overlapping_series_apply_revert_round_trip(tree, overlapping):
    before = tree_hash(tree)
    assert run(overlapping, tree).ok
    report = run(overlapping, tree, mode="revert")
    assert report.ok and statuses(report) == [("fix-a", "reverted"), ("fix-b", "reverted")]
    assert tree_hash(tree) == before


def test_independently_authored_fixes_on_one_file(tree, tmp_path, vllm_src):
    """B written against the pristine file, not after A: applies by context, reverts, re-applies."""
    a = author(tree, replace(ENVS, b"import logging\n", b"import logging\n# fix A\n"), tmp_path / "w")
    b = author(tree, replace(ENVS, b"import tempfile\n", b"import tempfile\n# fix B\n"), tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"fix-a": a, "fix-b": b}, ["fix-a", "fix-b"])
    before = tree_hash(tree)
    first = run(profile, tree)
    assert statuses(first) == [("fix-a", "patched"), ("fix-b", "patched")]
    assert [f.exact for f in first.fixes] == [True, False]
    assert "applies by context" in first.fixes[1].reason
    assert statuses(run(profile, tree)) == [("fix-a", "already applied"), ("fix-b", "already applied")]
    assert statuses(run(profile, tree, mode="revert")) == [("fix-a", "reverted"), ("fix-b", "reverted")]
    assert tree_hash(tree) == before
    assert statuses(run(profile, tree)) == [("fix-a", "patched"), ("fix-b", "patched")]
    assert "applies only by context (--strict)" in run(profile, make_tree(vllm_src, tmp_path / "t2"), strict=True).error


def test_index_line_naming_other_blobs_is_by_context(tree, tmp_path):
    patch = author(tree, replace(ENVS, b"import logging\n", b"import logging\n# marker\n"), tmp_path / "w")
    pre = patch.split(b"\nindex ")[1][:40]
    profile = make_profile(tmp_path / "p", {"bogus": patch.replace(pre, b"1" * 40)}, ["bogus"])
    check = run(profile, tree, mode="check")
    assert check.ok and check.fixes[0].exact is False
    assert f"the patch was written for {'1' * 40}" in check.fixes[0].reason
    strict = run(profile, tree, strict=True)
    assert strict.exit_code == 1 and "--strict" in strict.error


# ----------------------------------------------------------------------------- file kinds

def test_crlf_file_round_trip(tree, tmp_path):
    version = tree / "vllm/_version.py"
    version.write_bytes(version.read_bytes().replace(b"\n", b"\r\n"))
    patch = author(tree, replace("vllm/_version.py", b"version: str\r\n", b"version: str\r\n# crlf\r\n"),
                   tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"crlf": patch}, ["crlf"])
    before = tree_hash(tree)
    assert statuses(run(profile, tree)) == [("crlf", "patched")]
    assert b"version: str\r\n# crlf\r\n" in version.read_bytes()
    assert statuses(run(profile, tree)) == [("crlf", "already applied")]
    assert run(profile, tree, mode="revert").ok and tree_hash(tree) == before


def test_file_without_trailing_newline(tree, tmp_path):
    version = tree / "vllm/_version.py"
    version.write_bytes(version.read_bytes().rstrip(b"\n"))
    patch = author(tree, replace("vllm/_version.py", b"'gced6857af'", b"'gced6857af'  # last line"),
                   tmp_path / "w")
    assert b"\\ No newline at end of file" in patch
    profile = make_profile(tmp_path / "p", {"noeol": patch}, ["noeol"])
    before = tree_hash(tree)
    assert statuses(run(profile, tree)) == [("noeol", "patched")]
    assert version.read_bytes().endswith(b"# last line")
    assert statuses(run(profile, tree)) == [("noeol", "already applied")]
    assert run(profile, tree, mode="revert").ok and tree_hash(tree) == before


def test_create_file_in_existing_directory(tree, tmp_path):
    patch = author(tree, lambda w: (w / "vllm/cookbook_helper.py").write_text("HELPER = 1\n"), tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"create": patch}, ["create"])
    before = tree_hash(tree)
    assert statuses(run(profile, tree)) == [("create", "patched")]
    assert (tree / "vllm/cookbook_helper.py").read_text() == "HELPER = 1\n"
    assert statuses(run(profile, tree)) == [("create", "already applied")]
    assert run(profile, tree, mode="revert").ok and tree_hash(tree) == before


def test_create_file_in_new_directory(tree, tmp_path):
    def edit(w):
        (w / "vllm/cookbook_new").mkdir()
        (w / "vllm/cookbook_new/helper.py").write_text("HELPER = 1\n")
    profile = make_profile(tmp_path / "p", {"create": author(tree, edit, tmp_path / "w")}, ["create"])
    before = tree_hash(tree)
    report = run(profile, tree)
    assert report.ok, report.error
    assert (tree / "vllm/cookbook_new/helper.py").exists()
    assert run(profile, tree, mode="revert").ok
    assert tree_hash(tree) == before  # the new directory goes too


def test_delete_file_then_reapply(tree, tmp_path):
    patch = author(tree, lambda w: (w / ENVS).unlink(), tmp_path / "w")
    assert b"deleted file mode 100755" in patch
    profile = make_profile(tmp_path / "p", {"delete": patch}, ["delete"])
    assert statuses(run(profile, tree)) == [("delete", "patched")]
    assert not (tree / ENVS).exists()
    assert statuses(run(profile, tree)) == [("delete", "already applied")]


def test_delete_then_revert_restores_mode(tree, tmp_path):
    profile = make_profile(tmp_path / "p", {"delete": author(tree, lambda w: (w / ENVS).unlink(), tmp_path / "w")},
                           ["delete"])
    before = tree_hash(tree)
    assert run(profile, tree).ok and run(profile, tree, mode="revert").ok
    assert oct((tree / ENVS).stat().st_mode & 0o777) == "0o755"
    assert tree_hash(tree) == before


def test_rename_keeps_mode_and_round_trips(tree, tmp_path):
    patch = author(tree, lambda w: os.rename(w / ENVS, w / "vllm/envs_renamed.py"), tmp_path / "w")
    assert b"rename from vllm/envs.py" in patch
    profile = make_profile(tmp_path / "p", {"rename": patch}, ["rename"])
    before = tree_hash(tree)
    assert statuses(run(profile, tree)) == [("rename", "patched")]
    assert not (tree / ENVS).exists()
    assert statuses(run(profile, tree)) == [("rename", "already applied")]
    assert oct((tree / "vllm/envs_renamed.py").stat().st_mode & 0o777) == "0o755"
    assert run(profile, tree, mode="revert").ok and tree_hash(tree) == before


def test_mode_only_patch(tree, tmp_path):
    patch = author(tree, lambda w: os.chmod(w / "vllm/_version.py", 0o755), tmp_path / "w")
    assert b"new mode 100755" in patch
    profile = make_profile(tmp_path / "p", {"mode": patch}, ["mode"])
    assert statuses(run(profile, tree)) == [("mode", "patched")]
    assert (tree / "vllm/_version.py").stat().st_mode & 0o777 == 0o755
    assert statuses(run(profile, tree)) == [("mode", "already applied")]


def test_user_git_config_does_not_change_the_result(tree, tmp_path, monkeypatch):
    patch = author(tree, replace(ENVS, b"import logging\n", b"import logging\nMARK = 1   \n"), tmp_path / "w")
    profile = make_profile(tmp_path / "p", {"ws": patch}, ["ws"])
    config = tmp_path / "gitconfig"
    config.write_text("[apply]\n\twhitespace = fix\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    assert run(profile, tree).ok
    assert b"MARK = 1   \n" in (tree / ENVS).read_bytes()  # the patch's bytes, trailing blanks included


# ----------------------------------------------------------------------------- profiles and fixes

def _copy_fixture_fixes(where: Path) -> Path:
    shutil.copytree(FIXTURES / "fixes", where / "fixes")
    return where


@pytest.mark.parametrize("text", [
    "name: x\ntargets: [vllm]\nfixes-dir: fixes\nfixes: [envs-marker]\n",
    "name: x\nextends: v0.30.0\nfixes-dir: 5\nfixes: [envs-marker]\n",
], ids=["targets-list", "fixes-dir-int"])
def test_profile_wrong_types_are_usage_errors(tree, tmp_path, text):
    profile = _copy_fixture_fixes(tmp_path) / "profile.yaml"
    profile.write_text(text)
    done = cli("--profile", profile, "--vllm-root", tree, "--target", "vllm", "--check")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-500:]


def test_profile_unknown_key_is_refused(tree, tmp_path):
    profile = _copy_fixture_fixes(tmp_path) / "profile.yaml"
    profile.write_text("name: x\nextends: v0.30.0\nfixes-dir: fixes\nfixs: [envs-marker]\n")
    done = cli("--profile", profile, "--vllm-root", tree, "--target", "vllm", "--check")
    assert done.returncode == 3 and "fixs" in done.stderr


@pytest.mark.parametrize("text,message", [
    ("fixes: envs-marker\n", "fixes must be a list of names"),
    ("fixes: [envs-marker, envs-marker]\n", "fixes listed twice: ['envs-marker']"),
    ("fixes: [envs-marker]\nopt-in: [envs-marker]\n", "fixes listed twice: ['envs-marker']"),
    ("fixes: [envs-marker, no-such-fix]\n", "fix 'no-such-fix' has no"),
    ("targets:\n  vllm:\n    comit: abc\nfixes: []\n", "targets.vllm: unknown key(s) comit"),
], ids=["fixes-string", "twice", "default-and-opt-in", "folder-missing", "target-key-typo"])
def test_profile_errors_exit_3(tree, tmp_path, text, message):
    profile = _copy_fixture_fixes(tmp_path) / "profile.yaml"
    profile.write_text("name: x\nextends: v0.30.0\nfixes-dir: fixes\n" + text)
    with pytest.raises(CookbookError) as err:
        api.run(api.load_profile(str(profile)), {"vllm": tree}, [], mode="check", only_targets=["vllm"])
    assert err.value.exit_code == 3 and message in str(err.value)


def test_extends_loop_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(f"name: a\nextends: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"name: b\nextends: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(CookbookError) as err:
        api.load_profile(str(tmp_path / "a.yaml"))
    assert err.value.exit_code == 3 and "extends" in str(err.value)


def test_extends_relative_to_the_profile_file(tmp_path, monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the run's directory must not matter
    shutil.copy(REPO / "profiles" / "v0.30.0.yaml", tmp_path / "base.yaml")
    (tmp_path / "child.yaml").write_text("name: child\nextends: base.yaml\n")
    assert api.load_profile(str(tmp_path / "child.yaml")).targets["vllm"].commit == BASE


def _profile_with_fix_yaml(tmp_path: Path, text: str) -> Path:
    where = _copy_fixture_fixes(tmp_path)
    (where / "fixes/new").mkdir()
    (where / "fixes/new/fix.yaml").write_text(text)
    shutil.copy(FIXTURES / "fixes/sampler-marker/vllm.patch", where / "fixes/new/vllm.patch")
    shutil.copy(FIXTURES / "fixes/envs-marker/vllm.patch", where / "fixes/new/other.patch")
    (where / "profile.yaml").write_text("name: x\nextends: v0.30.0\nfixes-dir: fixes\nfixes: [new]\n")
    return where / "profile.yaml"


@pytest.mark.parametrize("text", [
    "title: t\ntargets: [vllm]\npatches:\n  target: vllm\nupstream:\n  status: merged\n",
    "title: t\ntargets: [vllm]\npatches: []\nupstream: merged\n",
    fix_yaml("new", "requires: envs-marker\n"),
], ids=["patches-mapping", "upstream-string", "requires-string"])
def test_fix_yaml_wrong_types(tree, tmp_path, text):
    done = cli("--profile", _profile_with_fix_yaml(tmp_path, text), "--vllm-root", tree, "--target", "vllm",
               "--check")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-500:]
    assert "must be a list" in done.stderr or "must be a mapping" in done.stderr


def test_fix_yaml_unknown_key_is_refused(tree, tmp_path):
    profile = _profile_with_fix_yaml(tmp_path, fix_yaml("new", "requries: [envs-marker]\n"))
    with pytest.raises(CookbookError) as err:
        api.run(api.load_profile(str(profile)), {"vllm": tree}, [], mode="check", only_targets=["vllm"])
    assert "requries" in str(err.value)


def test_fix_with_two_patches_for_one_target(tree, tmp_path):
    two = ("patches:\n  - target: vllm\n    file: vllm.patch\n    base: x\n"
           "  - target: vllm\n    file: other.patch\n    base: x\n")
    profile = _profile_with_fix_yaml(tmp_path, fix_yaml("new", patches=two))
    try:
        report = run(profile, tree)
    except CookbookError as exc:  # refusing it is fine too
        assert exc.exit_code == 3
        return
    assert report.ok
    assert "cookbook test fixture" in (tree / "vllm/v1/sample/sampler.py").read_text()  # vllm.patch


@pytest.mark.parametrize("file", ["../envs-marker/vllm.patch", str(FIXTURES / "fixes/envs-marker/vllm.patch")],
                         ids=["dot-dot", "absolute"])
def test_patch_file_outside_the_fix_folder(tree, tmp_path, file):
    patches = f"patches:\n  - target: vllm\n    file: {file}\n    base: x\n"
    profile = _profile_with_fix_yaml(tmp_path, fix_yaml("new", patches=patches))
    with pytest.raises(CookbookError) as err:
        run(profile, tree, mode="check")
    assert err.value.exit_code == 3 and "is outside" in str(err.value)


def test_verify_profile_with_alternative_opt_ins(tree, tmp_path):
    patch = (FIXTURES / "fixes/sampler-marker/vllm.patch").read_bytes()
    profile = make_profile(tmp_path / "p", {"alt-a": patch, "alt-b": patch}, [], opt_in=["alt-a", "alt-b"],
                           metas={"alt-b": "conflicts: [alt-a]\n"})
    assert run(profile, tree, mode="apply", opt_ins=["alt-b"]).ok  # each alternative alone is fine
    assert cli("verify", "--profile", profile, "--vllm-root", make_tree(tree, tmp_path / "t2"),
               "--target", "vllm").returncode == 0


def test_opt_in_named_twice_is_applied_once(tree):
    report = run(FIXTURE_PROFILE, tree, opt_ins=["sampler-marker", "sampler-marker"])
    assert [f.name for f in report.fixes] == ["envs-marker", "scheduler-marker", "envs-second-marker",
                                              "sampler-marker"]
    assert (tree / "vllm/v1/sample/sampler.py").read_text().count("cookbook test fixture") == 1


# ----------------------------------------------------------------------------- CLI contract

def test_unknown_target_exit_3(tree):
    done = cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm-gaudy", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout) == {"ok": False, "exit_code": 3, "error":
                                       "unknown target vllm-gaudy; profile engine-fixture has vllm, vllm-gaudi"}


@pytest.mark.parametrize("args", [["--no-such-option"], ["--check", "--revert"], ["-h"]],
                         ids=["unknown-option", "check-and-revert", "dash-h"])
def test_usage_errors_exit_3(tree, args):
    done = cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", *args)
    expected = (0, 3) if args == ["-h"] else (3,)  # -h: help, or at least a usage error
    assert done.returncode in expected, done.stderr


def test_help_names_commands_options_and_exit_codes():
    top = cli("--help")
    assert top.returncode == 0
    assert all(c in top.stdout for c in ("apply", "verify", "identify"))
    sub = cli("apply", "--help").stdout
    flat = " ".join(sub.split())
    for text in ("--check", "--revert", "--list", "--json", "--strict", "--target", "--vllm-root",
                 "--vllm-gaudi-root", "0 success", "1 a fix refused", "2 base mismatch", "3 usage"):
        assert text in flat, text


def test_check_predicts_read_only_refusal(tree, tmp_path):
    (tree / ENVS).chmod(0o444)
    assert run(FIXTURE_PROFILE, tree).exit_code == 1
    assert run(FIXTURE_PROFILE, tree, mode="check").exit_code == 1


def test_refused_run_reports_nothing_as_patched(tree):
    (tree / ENVS).chmod(0o444)
    out = json.loads(cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", "--json").stdout)
    assert out["exit_code"] == 1
    assert not [f["name"] for f in out["fixes"] if f["status"] == "patched"]


def test_json_fix_fields_named_in_the_issue(tree):
    out = json.loads(cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", "--json").stdout)
    for fix in out["fixes"]:
        assert {"name", "target", "status", "files", "exact", "reason"} <= set(fix), sorted(fix)


def test_json_report_of_a_by_context_failure(tree):
    sched = tree / "vllm/v1/core/sched/scheduler.py"
    sched.write_text(sched.read_text().replace("class Scheduler(SchedulerInterface):", "class Scheduler:"))
    envs = tree / ENVS
    envs.write_bytes(envs.read_bytes() + b"# edited\n")
    done = cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", "--check", "--json")
    out = json.loads(done.stdout)
    assert done.returncode == 1 and out["ok"] is False and out["exit_code"] == 1
    first, second, third = out["fixes"]
    # Nothing was written: the fix before the failure says what it would have done.
    assert (first["status"], first["exact"], first["files"]) == ("would patch", False, ["vllm/envs.py"])
    assert first["reason"].startswith("applies by context: vllm/envs.py is blob")
    assert second["status"] == "failed" and "does not match vllm/v1/core/sched/scheduler.py" in second["reason"]
    assert third["status"] == "" and third["exact"] is None


# ----------------------------------------------------------------------------- stamp

def _stamped(tree: Path) -> list[str] | None:
    path = tree / "vllm/cookbook-fixes.json"
    if not path.exists():
        return None
    return [f["name"] for f in json.loads(path.read_text())["profiles"]["engine-fixture"]["fixes"]]


def test_stamp_after_apply_revert_reapply(tree):
    before = tree_hash(tree)
    run(FIXTURE_PROFILE, tree, ["sampler-marker"])
    stamp = json.loads((tree / "vllm/cookbook-fixes.json").read_text())["profiles"]["engine-fixture"]
    assert stamp["commit_found"] == "ced6857af" and stamp["pin"] == BASE
    for fix in stamp["fixes"]:
        patch = REPO / fix["patches"][0]["file"]
        assert hashlib.sha256(patch.read_bytes()).hexdigest() == fix["patches"][0]["sha256"]
    run(FIXTURE_PROFILE, tree, ["sampler-marker"], mode="revert")
    assert _stamped(tree) is None and tree_hash(tree) == before
    run(FIXTURE_PROFILE, tree, ["sampler-marker"])
    assert _stamped(tree) == ["envs-marker", "scheduler-marker", "envs-second-marker", "sampler-marker"]


def test_stamp_keeps_an_applied_opt_in(tree):
    """The stamp describes the tree: a run keeps the opt-ins it records (and --revert removes them)."""
    before = tree_hash(tree)
    run(FIXTURE_PROFILE, tree, ["sampler-marker"])
    report = run(FIXTURE_PROFILE, tree)  # a later default run (e.g. a rebuild) that does not name it
    assert [f.status for f in report.fixes][-1] == "already applied"
    assert "cookbook test fixture" in (tree / "vllm/v1/sample/sampler.py").read_text()
    assert "sampler-marker" in _stamped(tree)
    reverted = run(FIXTURE_PROFILE, tree, mode="revert")
    assert [f.status for f in reverted.fixes] == ["reverted"] * 4
    assert _stamped(tree) is None and tree_hash(tree) == before


# ----------------------------------------------------------------------------- crashes, locks, roots

def test_sigkill_after_every_write_recovers_the_old_tree(tree):
    """The fixture series with the opt-in writes 4 files (3 sources + the stamp)."""
    before = tree_hash(tree)
    for writes in range(1, 5):
        env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES=str(writes))
        killed = cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", "sampler-marker", env=env)
        assert killed.returncode == -9, (writes, killed.stdout)
        recovery = run(FIXTURE_PROFILE, tree, mode="check")
        assert recovery.ok and len(recovery.recovered) == 4
        assert tree_hash(tree) == before, f"after a kill at write {writes}"
        assert not list(tree.glob(".cookbook-fixes-journal*"))


def test_kill_inside_a_new_file_write_leaves_no_temp_file(tree):
    before = tree_hash(tree)
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES="1")
    assert cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm", env=env).returncode == -9
    # The state a kill between open(tmp) and os.replace leaves: the journal, a partial temp, no stamp.
    stamp = tree / "vllm/cookbook-fixes.json"
    partial = stamp.read_bytes()[:10]
    stamp.unlink()
    (tree / "vllm/.cookbook-fixes.json.cookbook-tmp").write_bytes(partial)
    assert run(FIXTURE_PROFILE, tree, mode="check").ok
    assert not list(tree.rglob("*.cookbook-tmp"))
    assert tree_hash(tree) == before


def test_half_written_journal_is_discarded(tree):
    """A crash while journalling leaves only the staging directory (no manifest, nothing changed)."""
    before = tree_hash(tree)
    staging = tree / ".cookbook-fixes-journal.tmp-4242"
    staging.mkdir()
    (staging / "0").write_bytes((tree / ENVS).read_bytes()[:100])
    report = run(FIXTURE_PROFILE, tree, mode="check")
    assert report.ok and report.recovered == []
    assert tree_hash(tree) == before  # the staging directory is gone, nothing else touched


def test_journal_without_manifest_under_final_name(tree):
    (tree / ".cookbook-fixes-journal").mkdir()
    (tree / ".cookbook-fixes-journal/0").write_bytes(b"partial")
    done = cli("--profile", FIXTURE_PROFILE, "--vllm-root", tree, "--target", "vllm")
    assert "Traceback" not in done.stderr, done.stderr[-400:]
    assert done.returncode in (0, 1)


def test_concurrent_apply_and_revert_end_in_a_whole_state(tree, tmp_path):
    pristine = tree_hash(tree)
    patched_tree = make_tree(tree, tmp_path / "reference")
    run(FIXTURE_PROFILE, patched_tree)
    patched = tree_hash(patched_tree)
    for first_state in ("pristine", "patched"):
        procs = [subprocess.Popen([sys.executable, str(APPLY_ALL), "--profile", str(FIXTURE_PROFILE),
                                   "--vllm-root", str(tree), "--target", "vllm", *mode],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for mode in ([], ["--revert"])]
        for proc in procs:
            proc.communicate(timeout=120)
        assert [p.returncode for p in procs] == [0, 0], first_state
        assert tree_hash(tree) in (pristine, patched)
        assert not list(tree.glob(".cookbook-fixes-journal*"))


def test_root_given_as_a_symlink(tree, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tree)
    out = json.loads(cli("--profile", FIXTURE_PROFILE, "--vllm-root", link, "--target", "vllm", "--json").stdout)
    assert out["ok"] and out["targets"]["vllm"]["root"] == str(tree)
    assert link.is_symlink() and (tree / "vllm/cookbook-fixes.json").exists()
    assert "test fixture: envs marker" in (tree / ENVS).read_text()


def test_package_directory_symlinked_inside_the_root(tree, tmp_path):
    """Editable-style layouts: <root>/vllm is a symlink; the files behind it are patched in place."""
    real = tmp_path / "real-vllm"
    shutil.move(tree / "vllm", real)
    (tree / "vllm").symlink_to(real)
    assert run(FIXTURE_PROFILE, tree).ok
    assert (tree / "vllm").is_symlink() and "test fixture: envs marker" in (real / "envs.py").read_text()


def test_read_only_directory_as_root_user_or_refused(tree):
    """Root ignores directory permissions; anyone else must get a refusal before any write."""
    sample_dir = tree / "vllm/v1/sample"
    sample_dir.chmod(0o555)
    try:
        before = tree_hash(tree)
        report = run(FIXTURE_PROFILE, tree, ["sampler-marker"])
        if os.geteuid() == 0:
            assert report.ok
        else:
            assert report.exit_code == 1 and "not writable" in report.error and tree_hash(tree) == before
    finally:
        sample_dir.chmod(0o755)
