"""The fix-pack engine on real vLLM v0.30.0 files, through the real entry point.

Fixture patches (tests/engine/fixtures) each add a comment line to a real vLLM file; the failure
cases are built here from them, so every refusal is shown against real upstream code.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cookbook.profiles import load_profile
from cookbook.results import Mode

REPO = Path(__file__).resolve().parents[2]
APPLY_ALL = REPO / "fixes" / "apply_all.py"
FIXTURES = Path(__file__).parent / "fixtures"
PROFILE = FIXTURES / "profile.yaml"
TOUCHED = ["vllm/_version.py", "vllm/envs.py", "vllm/v1/core/sched/scheduler.py", "vllm/v1/sample/sampler.py"]


def make_tree(src: Path, dest: Path) -> Path:
    """The real vLLM files the fixture series touches (plus _version.py, which names the commit)."""
    for rel in TOUCHED:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, dest / rel)
    return dest


def tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        digest.update(str(rel).encode())
        if path.is_file():
            digest.update(oct(path.stat().st_mode).encode() + path.read_bytes())
    return digest.hexdigest()


def cli(*args, env=None, check_rc=None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(APPLY_ALL), *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=120)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stdout + done.stderr
    return done


def apply(root, *extra, profile=PROFILE, **kw):
    return cli("--profile", profile, "--vllm-root", root, "--target", "vllm", *extra, **kw)


def add_fix(fixes_dir: Path, name: str, patch: bytes, **meta) -> None:
    folder = fixes_dir / name
    folder.mkdir(parents=True)
    (folder / "vllm.patch").write_bytes(patch)
    extra = "".join(f"{k}: {json.dumps(v)}\n" for k, v in meta.items())
    (folder / "fix.yaml").write_text(
        f"title: {name}\ntargets: [vllm]\npatches:\n  - target: vllm\n    file: vllm.patch\n"
        f"    base: ced6857afa0ea7b2e3f0846a62e1394e90f15607\nupstream:\n  status: inappropriate\n{extra}")


def profile_with(tmp_path: Path, extra_fixes: dict[str, bytes], order: list[str], opt_in=(), **metas) -> Path:
    """A copy of the fixture profile with more fixes, in the given order."""
    fixes_dir = tmp_path / "fixes"
    shutil.copytree(FIXTURES / "fixes", fixes_dir)
    for name, patch in extra_fixes.items():
        add_fix(fixes_dir, name, patch, **metas.get(name, {}))
    profile = tmp_path / "profile.yaml"
    profile.write_text(f"name: custom\nextends: v0.30.0\nfixes-dir: fixes\nfixes: {json.dumps(order)}\n"
                       f"opt-in: {json.dumps(list(opt_in))}\n")
    return profile


@pytest.fixture
def tree(vllm_src, tmp_path) -> Path:
    return make_tree(vllm_src, tmp_path / "tree")


def fixture_patch(name: str) -> bytes:
    return (FIXTURES / "fixes" / name / "vllm.patch").read_bytes()


def test_applies_in_order_then_reports_already_applied(tree, vllm_src):
    first = apply(tree, "sampler-marker", check_rc=0)
    lines = [l for l in first.stdout.splitlines() if "] " in l]
    assert [l.split("] ")[1].split()[0] for l in lines] == [
        "envs-marker", "scheduler-marker", "envs-second-marker", "sampler-marker"]
    assert all("patched (exact)" in l for l in lines), first.stdout
    envs = (tree / "vllm/envs.py").read_text()
    assert envs.index("second envs marker") < envs.index("test fixture: envs marker")
    stamp = json.loads((tree / "vllm" / "cookbook-fixes.json").read_text())
    assert [f["name"] for f in stamp["profiles"]["engine-fixture"]["fixes"]][-1] == "sampler-marker"

    before = tree_hash(tree)
    second = apply(tree, "sampler-marker", check_rc=0)
    assert "OK: 4 already applied; nothing written" in second.stdout
    assert tree_hash(tree) == before


def test_json_report(tree):
    out = json.loads(apply(tree, "--json", check_rc=0).stdout)
    assert out["ok"] and out["exit_code"] == 0
    assert [(f["name"], f["status"], f["exact"]) for f in out["fixes"]] == [
        ("envs-marker", "patched", True), ("scheduler-marker", "patched", True),
        ("envs-second-marker", "patched", True)]
    assert out["fixes"][1]["files"] == ["vllm/v1/core/sched/scheduler.py"]
    assert out["targets"]["vllm"]["commit"] == "ced6857af"


def test_check_writes_nothing(tree):
    before = tree_hash(tree)
    out = apply(tree, "--check", check_rc=0).stdout
    assert "OK: 3 would patch; nothing written" in out and tree_hash(tree) == before


def test_wrong_base_is_refused_and_nothing_written(vllm_026_src, tmp_path):
    tree = tmp_path / "old"
    (tree / "vllm").mkdir(parents=True)
    shutil.copy2(vllm_026_src / "vllm/_version.py", tree / "vllm/_version.py")
    for rel in TOUCHED[1:]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(vllm_026_src / rel, tree / rel)
    before = tree_hash(tree)
    done = apply(tree, check_rc=2)
    assert "expected commit ced6857afa0ea7b2e3f0846a62e1394e90f15607" in done.stdout
    assert "found f2654939e" in done.stdout
    assert tree_hash(tree) == before


def test_wrong_base_is_refused_before_any_patch_is_read(vllm_026_src, tmp_path):
    """A wrong base with a malformed patch in the series is a base mismatch (2), not a patch
    failure (1): the pin is checked before any patch is parsed."""
    tree = tmp_path / "old"
    (tree / "vllm").mkdir(parents=True)
    shutil.copy2(vllm_026_src / "vllm/_version.py", tree / "vllm/_version.py")
    profile = profile_with(tmp_path / "p", {"broken": b"diff --git a/vllm/x b/vllm/x\n@@ -1 +1 @@\n"},
                           ["envs-marker", "broken"])
    done = apply(tree, profile=profile, check_rc=2)
    assert "expected commit ced6857a" in done.stdout and "malformed" not in done.stdout


def test_unidentifiable_base_is_refused(tree):
    (tree / "vllm/_version.py").unlink()
    done = apply(tree, check_rc=2)
    assert "found none" in done.stdout


def test_edited_file_fails_naming_the_hunk_and_restores_everything(tree):
    sched = tree / "vllm/v1/core/sched/scheduler.py"
    text = sched.read_text().replace("class Scheduler(SchedulerInterface):",
                                     "class Scheduler(SchedulerInterface):  # edited")
    sched.write_text(text)
    before = tree_hash(tree)
    done = apply(tree, check_rc=1)
    assert "scheduler-marker" in done.stdout and "failed" in done.stdout
    assert "hunk @@ -76,6 +76,7 @@" in done.stdout and "does not match vllm/v1/core/sched/scheduler.py" in done.stdout
    assert tree_hash(tree) == before  # envs-marker (the fix before) was not written either


def test_failure_in_kth_fix_leaves_tree_byte_identical(tree, tmp_path):
    broken = fixture_patch("sampler-marker").replace(b"class Sampler(nn.Module):", b"class Nope(nn.Module):")
    profile = profile_with(tmp_path, {"broken": broken},
                           ["envs-marker", "scheduler-marker", "envs-second-marker", "broken"])
    before = tree_hash(tree)
    done = apply(tree, profile=profile, check_rc=1)
    assert "[ 4/4] broken" in done.stdout and "REFUSED" in done.stdout
    assert tree_hash(tree) == before


def test_partial_previous_run_completes(tree):
    # A person applied the first fix by hand: the run finishes the series.
    subprocess.run(["git", "apply", str(FIXTURES / "fixes/envs-marker/vllm.patch")], cwd=tree, check=True)
    done = apply(tree, check_rc=0)
    assert "envs-marker         already applied" in done.stdout
    assert done.stdout.count("patched (exact)") == 2


def test_strict_refuses_by_context(tree):
    sched = tree / "vllm/v1/core/sched/scheduler.py"
    sched.write_text(sched.read_text() + "\n# edited far from the hunk\n")
    ok = apply(tree, "--check", check_rc=0).stdout
    assert "scheduler-marker    would patch (by context)" in ok
    strict = apply(tree, "--strict", check_rc=1).stdout
    assert "applies only by context (--strict)" in strict


def test_sigkill_mid_write_is_recovered_by_next_run(tree):
    before = tree_hash(tree)
    env = dict(os.environ, COOKBOOK_TEST_KILL_AFTER_WRITES="2")
    done = apply(tree, "sampler-marker", env=env)
    assert done.returncode == -signal.SIGKILL
    assert (tree / ".cookbook-fixes-journal" / "manifest.json").exists()
    assert tree_hash(tree) != before  # half written: exactly what the journal is for
    check = apply(tree, "--check", check_rc=0).stdout
    assert "recovered an interrupted run" in check and "would patch" in check
    assert not (tree / ".cookbook-fixes-journal").exists()
    assert tree_hash(tree) == before
    apply(tree, "sampler-marker", check_rc=0)


def test_revert_restores_pristine(tree):
    before = tree_hash(tree)
    apply(tree, "sampler-marker", check_rc=0)
    out = apply(tree, "--revert", "sampler-marker", check_rc=0).stdout
    assert out.count("reverted (exact)") == 4
    assert tree_hash(tree) == before


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


@pytest.mark.parametrize("bad_path,reason", [
    ("../outside.py", "contains '..'"),
    ("/etc/passwd", "is absolute"),
    ("other_pkg/x.py", "is outside the target package vllm/"),
])
def test_unsafe_paths_are_refused(tree, tmp_path, bad_path, reason):
    patch = fixture_patch("envs-marker").replace(b"vllm/envs.py", bad_path.lstrip("/").encode())
    if bad_path.startswith("/"):
        patch = patch.replace(b"a/etc/passwd", b"a//etc/passwd").replace(b"b/etc/passwd", b"b//etc/passwd")
    profile = profile_with(tmp_path, {"evil": patch}, ["envs-marker", "evil"])
    before = tree_hash(tree)
    done = apply(tree, profile=profile, check_rc=1)
    assert reason in done.stdout and "refusing before any write" in done.stdout
    assert tree_hash(tree) == before


def test_symlink_leaving_the_tree_is_refused(tree, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "envs.py").write_bytes((tree / "vllm/envs.py").read_bytes())
    (tree / "vllm/escape").symlink_to(outside)
    patch = fixture_patch("envs-marker").replace(b"vllm/envs.py", b"vllm/escape/envs.py")
    profile = profile_with(tmp_path, {"evil": patch}, ["evil"])
    done = apply(tree, profile=profile, check_rc=1)
    assert "resolves through a symlink" in done.stdout
    assert (outside / "envs.py").read_bytes() == (tree / "vllm/envs.py").read_bytes()


def test_malformed_patch_is_refused(tree, tmp_path):
    truncated = fixture_patch("scheduler-marker").rsplit(b"\n", 3)[0] + b"\n"
    profile = profile_with(tmp_path, {"bad": truncated}, ["envs-marker", "bad"])
    before = tree_hash(tree)
    done = apply(tree, profile=profile, check_rc=1)
    assert "malformed patch" in done.stdout
    assert tree_hash(tree) == before


def test_short_index_lines_are_refused(tree, tmp_path):
    patch = fixture_patch("envs-marker")
    first, rest = patch.split(b"\nindex ", 1)
    ids, rest = rest.split(b" ", 1)
    pre, post = ids.split(b"..")
    profile = profile_with(tmp_path, {"short": first + b"\nindex " + pre[:7] + b".." + post[:7] + b" " + rest}, ["short"])
    assert "full blob ids" in apply(tree, profile=profile, check_rc=1).stdout


def test_read_only_file_is_refused_before_any_write(tree):
    target = tree / "vllm/v1/sample/sampler.py"
    target.chmod(0o444)
    before = tree_hash(tree)
    done = apply(tree, "sampler-marker", check_rc=1)
    assert "sampler.py is read-only" in done.stdout
    assert tree_hash(tree) == before


def test_unknown_opt_in_lists_valid_ones(tree):
    done = apply(tree, "no-such-fix", check_rc=3)
    assert "unknown fix 'no-such-fix'" in done.stderr and "sampler-marker" in done.stderr


def test_requires_and_conflicts(tree, tmp_path):
    needs = profile_with(tmp_path / "a", {"needy": fixture_patch("envs-second-marker")}, ["envs-marker"],
                         opt_in=["sampler-marker", "needy"], needy={"requires": ["sampler-marker"]})
    assert "requires sampler-marker" in apply(tree, "needy", profile=needs, check_rc=3).stderr
    apply(tree, "needy", "sampler-marker", "--check", profile=needs, check_rc=0)
    clash = profile_with(tmp_path / "b", {"rival": fixture_patch("sampler-marker")}, ["envs-marker"],
                         opt_in=["rival"], rival={"conflicts": ["envs-marker"]})
    assert "conflicts with envs-marker" in apply(tree, "rival", profile=clash, check_rc=3).stderr


@pytest.mark.parametrize("default_meta,message", [
    ({"requires": ["sampler-marker"]}, "default fix needy requires the opt-in sampler-marker"),
    ({"conflicts": ["envs-marker"]}, "default fix needy conflicts with the default envs-marker"),
    ({"requires": ["no-such-fix"]}, "needy requires or conflicts with no-such-fix"),
], ids=["default-needs-opt-in", "defaults-clash", "unknown-name"])
def test_impossible_relations_are_refused_when_the_profile_loads(tree, tmp_path, default_meta, message):
    profile = profile_with(tmp_path, {"needy": fixture_patch("envs-second-marker")}, ["envs-marker", "needy"],
                           opt_in=["sampler-marker"], needy=default_meta)
    for args in (["--list"], ["--vllm-root", tree, "--check"]):
        done = cli("--profile", profile, *args)
        assert done.returncode == 3 and message in done.stderr, done.stderr


def test_one_planner_for_every_mode():
    profile = load_profile(str(PROFILE))
    names = lambda passes: [[f.name for f in series] for series in passes]  # noqa: E731
    assert names(profile.plan([])) == [["envs-marker", "scheduler-marker", "envs-second-marker"]]
    assert names(profile.plan([], stamped=["sampler-marker"]))[0][-1] == "sampler-marker"
    assert names(profile.plan([], mode=Mode.VERIFY)) == [profile.all_fixes]
    assert names(profile.only(["scheduler-marker", "sampler-marker"]).plan([])) == [["scheduler-marker", "sampler-marker"]]


def test_fix_without_patch_refuses_the_profile(tree, tmp_path):
    profile = profile_with(tmp_path, {}, ["envs-marker", "later"])
    folder = tmp_path / "fixes" / "later"
    folder.mkdir()
    (folder / "fix.yaml").write_text("title: later\ntargets: [vllm]\npatches: []\nupstream:\n  status: not-yet\n")
    listing = cli("--profile", profile, "--list", check_rc=0).stdout
    assert "later" in listing and "not yet available" in listing
    before = tree_hash(tree)
    done = apply(tree, profile=profile, check_rc=1)
    assert "not yet available: later" in done.stdout
    assert tree_hash(tree) == before


def test_out_of_scope_target_is_reported(tree):
    # The real profile: with --target vllm the vllm-gaudi fixes are out of scope, not applied.
    out = cli("--profile", "v0.30.0", "--vllm-root", tree, "--target", "vllm", "--check", "--json")
    report = json.loads(out.stdout)
    assert report["scope"] == ["vllm"]
    assert {f["status"] for f in report["fixes"] if f["targets"] == ["vllm-gaudi"]} == {"out of scope"}


def _git(repo: Path, *args):
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


def test_commit_from_git_checkout(tree):
    (tree / "vllm/_version.py").unlink()
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-qm", "not the pin")
    done = apply(tree, check_rc=2)
    assert "(git checkout at" in done.stdout


def test_commit_from_direct_url_checkout(tree, tmp_path):
    """The stock image: a non-editable install in site-packages whose direct_url.json names the
    checkout it was built from."""
    checkout = tmp_path / "workspace" / "vllm-project"
    shutil.copytree(tree, checkout)
    _git(checkout, "init", "-q")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-qm", "checkout")
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    site = tmp_path / "site-packages"
    shutil.copytree(tree / "vllm", site / "vllm")
    (site / "vllm/_version.py").unlink()
    info = site / "vllm-0.30.0+empty.dist-info"
    info.mkdir()
    (info / "direct_url.json").write_text(json.dumps({"url": checkout.as_uri(), "dir_info": {}}))
    out = cli("identify", "--profile", "v0.30.0", "--vllm-root", site, "--target", "vllm", check_rc=2).stdout
    assert f"{head} at {site}" in out and f"direct_url.json -> git checkout {checkout}" in out


def test_verify_reports_pin_without_enforcing_it(vllm_026_src, tmp_path):
    tree = make_tree(vllm_026_src, tmp_path / "t")
    done = cli("verify", "--profile", PROFILE, "--vllm-root", tree, "--target", "vllm")
    assert "DOES NOT match pin" in done.stdout  # reported, and the patches are still tried


def test_library_dependencies_missing_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "-S", "-c", f"import runpy, sys; sys.argv=['apply_all.py','--list'];"
                           f"runpy.run_path({str(APPLY_ALL)!r}, run_name='__main__')"],
                          capture_output=True, text=True)
    assert done.returncode == 3 and "requirements/cookbook.txt" in done.stderr


def test_default_root_is_the_installed_package(tree):
    """Without --vllm-root the package is found where Python would import it from, unimported."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = cli("identify", "--profile", "v0.30.0", "--target", "vllm", env=env, check_rc=0).stdout
    assert f"at {tree} " in out
