"""Fixtures of the cookbook tests (helpers: cookbook_trees.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cookbook_trees import ENVS, author, make_profile, make_tree, replace


@pytest.fixture
def tree(vllm_src, tmp_path) -> Path:
    """The real vLLM files the fixture series touches (plus _version.py, which names the commit)."""
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
