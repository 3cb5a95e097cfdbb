"""Profiles and fix metadata (cookbook.profiles): validation when a profile loads, the one series
planner, requires/conflicts.
"""
from __future__ import annotations

import shutil

import pytest

from cookbook import api
from cookbook.errors import CookbookError
from cookbook.profiles import load_profile
from cookbook.results import Mode
from cookbook_trees import (
    BASE, FIXTURES, PROFILE, REPO, apply, cli, copy_fixture_fixes, fix_yaml, fixture_patch,
    profile_with, profile_with_fix_yaml, run)


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


@pytest.mark.parametrize("text", [
    "name: x\ntargets: [vllm]\nfixes-dir: fixes\nfixes: [envs-marker]\n",
    "name: x\nextends: v0.30.0\nfixes-dir: 5\nfixes: [envs-marker]\n",
], ids=["targets-list", "fixes-dir-int"])
def test_profile_wrong_types_are_usage_errors(tree, tmp_path, text):
    profile = copy_fixture_fixes(tmp_path) / "profile.yaml"
    profile.write_text(text)
    done = cli("--profile", profile, "--vllm-root", tree, "--target", "vllm", "--check")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-500:]


def test_profile_unknown_key_is_refused(tree, tmp_path):
    profile = copy_fixture_fixes(tmp_path) / "profile.yaml"
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
    profile = copy_fixture_fixes(tmp_path) / "profile.yaml"
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
    shutil.copy(REPO / "profiles" / "v0.30.0.vllm-content.txt", tmp_path)  # a file the profile names
    (tmp_path / "child.yaml").write_text("name: child\nextends: base.yaml\n")
    assert api.load_profile(str(tmp_path / "child.yaml")).targets["vllm"].commit == BASE


@pytest.mark.parametrize("text", [
    "title: t\ntargets: [vllm]\npatches:\n  target: vllm\nupstream:\n  status: merged\n",
    "title: t\ntargets: [vllm]\npatches: []\nupstream: merged\n",
    fix_yaml("new", "requires: envs-marker\n"),
], ids=["patches-mapping", "upstream-string", "requires-string"])
def test_fix_yaml_wrong_types(tree, tmp_path, text):
    done = cli("--profile", profile_with_fix_yaml(tmp_path, text), "--vllm-root", tree, "--target", "vllm",
               "--check")
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr[-500:]
    assert "must be a list" in done.stderr or "must be a mapping" in done.stderr


def test_fix_yaml_unknown_key_is_refused(tree, tmp_path):
    profile = profile_with_fix_yaml(tmp_path, fix_yaml("new", "requries: [envs-marker]\n"))
    with pytest.raises(CookbookError) as err:
        api.run(api.load_profile(str(profile)), {"vllm": tree}, [], mode="check", only_targets=["vllm"])
    assert "requries" in str(err.value)


def test_fix_with_two_patches_for_one_target(tree, tmp_path):
    two = ("patches:\n  - target: vllm\n    file: vllm.patch\n    base: x\n"
           "  - target: vllm\n    file: other.patch\n    base: x\n")
    profile = profile_with_fix_yaml(tmp_path, fix_yaml("new", patches=two))
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
    profile = profile_with_fix_yaml(tmp_path, fix_yaml("new", patches=patches))
    with pytest.raises(CookbookError) as err:
        run(profile, tree, mode="check")
    assert err.value.exit_code == 3 and "is outside" in str(err.value)


def test_patches_without_a_base_take_their_targets_authored_against():
    profile = load_profile("v0.30.0")
    authored = profile.targets["vllm-gaudi"].authored_against
    assert authored.commit != profile.targets["vllm-gaudi"].commit  # the point: the pin is not public
    gaudi = [p for name in profile.all_fixes for p in profile.fix(name).patches if p.target == "vllm-gaudi"]
    assert gaudi and all((p.base.commit, p.base.ref) == (authored.commit, authored.ref) for p in gaudi)
    seeded = profile.fix("seeded-sampling").patches[0].base.note  # its own note follows the profile's
    assert seeded.startswith(authored.note) and "re-based with the series" in seeded
    vllm = profile.fix("rank-exception-fatal").patches[0].base  # a base of its own is kept
    assert (vllm.commit, vllm.ref, vllm.note) == (BASE, "v0.30.0", "")


def test_extends_keeps_authored_against_and_gaudi_sw(tmp_path):
    stock = load_profile("v0.30.0")
    (tmp_path / "child.yaml").write_text(
        "name: child\nextends: v0.30.0\ntargets:\n  vllm-gaudi:\n    commit: 0123abcd\n    ref: main\n")
    child = load_profile(str(tmp_path / "child.yaml"))
    assert child.targets["vllm-gaudi"].authored_against == stock.targets["vllm-gaudi"].authored_against
    assert child.gaudi_sw == stock.gaudi_sw == "1.24.1"
    (tmp_path / "other.yaml").write_text("name: other\nextends: child.yaml\ngaudi-sw: 1.25.0\n")
    assert load_profile(str(tmp_path / "other.yaml")).gaudi_sw == "1.25.0"


def test_a_patch_without_base_needs_its_targets_authored_against(tmp_path):
    patches = "patches:\n  - target: vllm\n    file: vllm.patch\n"  # vllm has no authored-against
    with pytest.raises(CookbookError) as err:
        api.load_profile(str(profile_with_fix_yaml(tmp_path, fix_yaml("new", patches=patches))))
    assert err.value.exit_code == 3 and "lacks base" in str(err.value) and "authored-against" in str(err.value)
