"""The fix-pack engine end to end on real vLLM v0.30.0 files, through the real entry point:
series applied in order, re-runs, wrong bases, refusals that leave the tree byte-identical.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from cookbook_trees import (
    APPLY_ALL, FIXTURES, PROFILE, TOUCHED, apply, cli, fixture_patch, make_tree, profile_with,
    tree_hash)


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


def test_revert_restores_pristine(tree):
    before = tree_hash(tree)
    apply(tree, "sampler-marker", check_rc=0)
    out = apply(tree, "--revert", "sampler-marker", check_rc=0).stdout
    assert out.count("reverted (exact)") == 4
    assert tree_hash(tree) == before


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
    # A regular package, as installed: a bare folder would be a namespace portion, which Python
    # passes over for any regular vllm further down the path (the test venv imports the pinned sdist).
    (tree / "vllm" / "__init__.py").touch()
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = cli("identify", "--profile", "v0.30.0", "--target", "vllm", env=env, check_rc=0).stdout
    assert f"at {tree} " in out
