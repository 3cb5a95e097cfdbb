"""Identifying a tree's commit (cookbook.sources): git checkouts, direct_url.json, checkouts git
cannot read.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

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
