"""Reading patches (cookbook.patchfile): unsafe paths, symbolic links, malformed patches, paths
with spaces and names git quotes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cookbook_trees import (
    ENVS, apply, author, fixture_patch, make_profile, one_line_refusal, profile_with, replace,
    tree_hash)


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
