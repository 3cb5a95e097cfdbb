"""`make image` end to end against a real Docker engine and bases made here (see tools/stand_in_bases.py).

The builder runs as users run it (`python3 -m builder build ...`, what `make image` calls).
Because releases/v0.30.0 (058f107) is not public, the matching base carries vllm-gaudi main at
091bbadd and is judged against tests/builder/profiles/test-base.yaml (v0.30.0 with that one pin
changed); the real v0.30.0 profile must refuse the same base.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import stand_in_bases

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


@pytest.fixture(scope="module")
def repo_snapshot(tmp_path_factory) -> Path:
    """The repository's files as they are now: the working tree may change while the tests run,
    and the cache test needs a build context that does not."""
    dest = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    return dest


def port_tag(base: str) -> str:
    return f"{stand_in_bases.IMAGE_REPO}/inkling-small:{base.rsplit(':', 1)[1]}"


@pytest.fixture(scope="module")
def port_image(docker_engine, base_v030, has_vllm_gaudi_source, repo_snapshot):
    if not has_vllm_gaudi_source:
        pytest.skip("the port's runner patch needs vllm-gaudi source in the base: set "
                    "VLLM_GAUDI_SRC (or VLLM_GAUDI_MIRROR); the stand-in carries version metadata only")
    tag = port_tag(base_v030)
    proc = make_image(base_v030, tag, cwd=repo_snapshot)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout[-3000:]
    return tag, json.loads(proc.stdout), proc.stderr


@pytest.mark.timeout(1500)
def test_matching_base_builds_labels_and_passes_preflight(docker_engine, base_v030, port_image):
    tag, result, log = port_image
    assert "base OK for profile" in log and "Step 1/" in log  # progress a person can follow
    assert result["preflight"]["ok"], result["preflight"]
    checks = {c["name"]: c for c in result["preflight"]["checks"]}
    assert checks["port runner patches"]["status"] == "pass"
    assert checks["plugin"]["status"] == "pass"
    # the stand-in base has vLLM's files but no torch to resolve parsers with, and says so
    assert checks["parsers"]["status"] == "skip", checks["parsers"]
    assert "torch not importable" in checks["parsers"]["detail"], checks["parsers"]
    labels = docker_engine.images.get(tag).labels
    assert labels["gaudi-cookbook.profile"] == "test-base"
    assert labels["gaudi-cookbook.vllm.commit"].startswith("ced6857af")
    assert labels["gaudi-cookbook.vllm-gaudi.commit"].startswith("091bbadd")
    assert "decode-window" in labels["gaudi-cookbook.fixes"].split(",")
    assert labels["org.opencontainers.image.base.name"] == base_v030
    stamp_sha = labels["gaudi-cookbook.stamp.vllm-gaudi.sha256"]
    assert stamp_sha == result["preflight"]["stamps"]["vllm-gaudi"]["sha256"]
    # The image carries the repository and the stamp the label names.
    out = docker_engine.containers.run(
        tag, entrypoint=["sh", "-c"], network_mode="none", remove=True,
        command=[f"sha256sum {result['preflight']['stamps']['vllm-gaudi']['path']} && "
                 "test -f /opt/gaudi-cookbook/fixes/apply_all.py && echo repo-ok"]).decode()
    assert stamp_sha in out and "repo-ok" in out


@pytest.mark.timeout(900)
def test_recipe_fix_step_works_inside_the_image(docker_engine, port_image):
    tag, _result, _log = port_image
    container = docker_engine.containers.run(
        tag, entrypoint=["python3"], network_mode="none", detach=True,
        command=["/opt/gaudi-cookbook/fixes/apply_all.py", "--profile",
                 f"/opt/gaudi-cookbook/{TEST_PROFILE}", "vllm-long-prefill-share", "--json"])
    try:
        status = container.wait(timeout=600)["StatusCode"]
        out = container.logs(stderr=False).decode()
        err = container.logs(stdout=False).decode()
    finally:
        container.remove(force=True)
    assert status == 0, out[-4000:] + err[-2000:]
    report = json.loads(out)
    assert {f["name"] for f in report["fixes"] if f["status"] == "patched"} >= {"vllm-long-prefill-share"}
    assert all(f["status"] in ("patched", "already applied") for f in report["fixes"]), report["fixes"]


@pytest.mark.timeout(900)
def test_rebuild_with_nothing_changed_hits_the_layer_cache(docker_engine, base_v030, port_image,
                                                           repo_snapshot):
    tag, first, _log = port_image
    proc = make_image(base_v030, tag, "--no-preflight", cwd=repo_snapshot)
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
