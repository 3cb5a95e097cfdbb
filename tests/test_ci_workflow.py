"""The CI workflow users' CI systems run (.github/workflows/ci.yml, GitHub Actions' format): valid YAML of
that schema's shape, triggered on pull requests and on a schedule, running `make check` and .ci/run, every
action pinned to a version, and every make target it names defined."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / ".github" / "workflows" / "ci.yml"


def load() -> dict:
    data = yaml.safe_load(WORKFLOW.read_text())
    data["on"] = data.pop(True, data.get("on"))       # YAML 1.1 reads the key `on` as true
    return data


def test_triggers_on_pull_requests_and_on_a_schedule():
    on = load()["on"]
    assert "pull_request" in on and "workflow_dispatch" in on
    crons = [entry["cron"] for entry in on["schedule"]]
    assert crons and all(len(cron.split()) == 5 for cron in crons), crons


def test_jobs_have_the_schema_s_shape_and_run_the_checks():
    jobs = load()["jobs"]
    runs = {}
    for name, job in jobs.items():
        assert set(job) <= {"runs-on", "timeout-minutes", "steps", "if", "needs", "env"}, (name, set(job))
        assert job["runs-on"] and job["steps"], name
        for step in job["steps"]:
            assert set(step) <= {"uses", "with", "name", "run", "env", "if"} and ("uses" in step) != ("run" in step), step
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", step["uses"]), step["uses"]
            else:
                runs.setdefault(name, []).append(step["run"])
    assert any("make check" in run for run in runs["check"])
    assert any("bash .ci/run" in run for run in runs["test"])
    assert any("apply_all.py verify" in run for run in runs["upstream-drift"])
    targets = set(re.findall(r"^([A-Za-z][\w-]*):(?!=)", (REPO / "Makefile").read_text(), re.M))
    for run in (r for rs in runs.values() for r in rs):
        for target in re.findall(r"\bmake (\w[\w-]*)", run):
            assert target in targets, target
