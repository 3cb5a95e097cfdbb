"""The command line contract (cookbook.cli): exit codes, usage errors, help, JSON and text reports.
"""
from __future__ import annotations

import json

import pytest

from cookbook_trees import ENVS, PROFILE, apply, cli, one_line_refusal, run


def test_unknown_target_exit_3(tree):
    done = cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm-gaudy", "--json")
    assert done.returncode == 3
    assert json.loads(done.stdout) == {"ok": False, "exit_code": 3, "error":
                                       "unknown target vllm-gaudy; profile engine-fixture has vllm, vllm-gaudi"}


@pytest.mark.parametrize("args", [["--no-such-option"], ["--check", "--revert"], ["-h"]],
                         ids=["unknown-option", "check-and-revert", "dash-h"])
def test_usage_errors_exit_3(tree, args):
    done = cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", *args)
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
    assert run(PROFILE, tree).exit_code == 1
    assert run(PROFILE, tree, mode="check").exit_code == 1


def test_refused_run_reports_nothing_as_patched(tree):
    (tree / ENVS).chmod(0o444)
    out = json.loads(cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", "--json").stdout)
    assert out["exit_code"] == 1
    assert not [f["name"] for f in out["fixes"] if f["status"] == "patched"]


def test_json_fix_fields_named_in_the_issue(tree):
    out = json.loads(cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", "--json").stdout)
    for fix in out["fixes"]:
        assert {"name", "target", "status", "files", "exact", "reason"} <= set(fix), sorted(fix)


def test_json_report_of_a_by_context_failure(tree):
    sched = tree / "vllm/v1/core/sched/scheduler.py"
    sched.write_text(sched.read_text().replace("class Scheduler(SchedulerInterface):", "class Scheduler:"))
    envs = tree / ENVS
    envs.write_bytes(envs.read_bytes() + b"# edited\n")
    done = cli("--profile", PROFILE, "--vllm-root", tree, "--target", "vllm", "--check", "--json")
    out = json.loads(done.stdout)
    assert done.returncode == 1 and out["ok"] is False and out["exit_code"] == 1
    first, second, third = out["fixes"]
    # Nothing was written: the fix before the failure says what it would have done.
    assert (first["status"], first["exact"], first["files"]) == ("would patch", False, ["vllm/envs.py"])
    assert first["reason"].startswith("applies by context: vllm/envs.py is blob")
    assert second["status"] == "failed" and "does not match vllm/v1/core/sched/scheduler.py" in second["reason"]
    assert third["status"] == "" and third["exact"] is None


def test_root_without_the_package_is_a_base_mismatch(tmp_path):
    (tmp_path / "empty").mkdir()
    one_line_refusal(apply(tmp_path / "empty"), 2, "no vllm/ package directory")


def test_usage_error_with_json_prints_a_json_object(tree):
    done = apply(tree, "--json", "--no-such-option")
    assert done.returncode == 3
    answer = json.loads(done.stdout)
    assert answer["ok"] is False and answer["exit_code"] == 3 and "--no-such-option" in answer["error"]
