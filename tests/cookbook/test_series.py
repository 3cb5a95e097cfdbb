"""Working a series out (cookbook.series): overlapping and independent fixes, file kinds (CRLF,
no trailing newline, created, deleted, renamed files), modes and owners, the user's git config.
"""
from __future__ import annotations

import os
from pathlib import Path

from cookbook_trees import (
    ENVS, FIXTURES, OTHER_USER, PROFILE, SCHEDULER, apply, author, cli, make_profile, make_tree,
    replace, run, statuses, tree_hash)


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


def test_verify_profile_with_alternative_opt_ins(tree, tmp_path):
    patch = (FIXTURES / "fixes/sampler-marker/vllm.patch").read_bytes()
    profile = make_profile(tmp_path / "p", {"alt-a": patch, "alt-b": patch}, [], opt_in=["alt-a", "alt-b"],
                           metas={"alt-b": "conflicts: [alt-a]\n"})
    assert run(profile, tree, mode="apply", opt_ins=["alt-b"]).ok  # each alternative alone is fine
    assert cli("verify", "--profile", profile, "--vllm-root", make_tree(tree, tmp_path / "t2"),
               "--target", "vllm").returncode == 0


def test_opt_in_named_twice_is_applied_once(tree):
    report = run(PROFILE, tree, opt_ins=["sampler-marker", "sampler-marker"])
    assert [f.name for f in report.fixes] == ["envs-marker", "scheduler-marker", "envs-second-marker",
                                              "sampler-marker"]
    assert (tree / "vllm/v1/sample/sampler.py").read_text().count("cookbook test fixture") == 1


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
