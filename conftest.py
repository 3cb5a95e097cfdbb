"""Fixtures shared by every test folder: real upstream sources, fetched or named at test time,
never committed. A test phase of over a minute is reported as it ends, on the session's clock."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cookbook import upstream


@pytest.fixture(scope="session")
def vllm_src() -> Path:
    """Pristine vLLM v0.30.0 sdist tree (sha256-pinned, cached). Never modify it. VLLM_SRC names another
    tree holding vllm/ instead: the in-image preflight points it at the image's installed vLLM."""
    if os.environ.get("VLLM_SRC"):
        path = Path(os.environ["VLLM_SRC"])
        if not (path / "vllm").is_dir():
            pytest.fail(f"VLLM_SRC={path} has no vllm/ package directory")
        return path
    return upstream.vllm_source()


@pytest.fixture(scope="session")
def vllm_026_src() -> Path:
    """Pristine vLLM v0.26.0 sdist tree: a known wrong base."""
    return upstream.vllm_source("0.26.0")


@pytest.fixture(scope="session")
def vllm_gaudi_src() -> Path:
    """A vllm-gaudi source tree named by VLLM_GAUDI_SRC (the profile's vllm-gaudi authored-against
    commit, main 091bbadd: tools/vllm_gaudi_src.sh); skips when unset."""
    src = os.environ.get("VLLM_GAUDI_SRC")
    if not src:
        pytest.skip("VLLM_GAUDI_SRC is not set: no vllm-gaudi source tree to test against")
    path = Path(src)
    if not (path / "vllm_gaudi").is_dir():
        pytest.fail(f"VLLM_GAUDI_SRC={src} has no vllm_gaudi/ package directory")
    return path


SLOW_PHASE_SECONDS = 60
_session_started = time.monotonic()
_config = None


def pytest_configure(config):
    global _config
    _config = config


def pytest_runtest_logreport(report):
    """--durations prints only when the session ends; a run stopped by CI's time limit still says where its
    minutes went."""
    if report.duration >= SLOW_PHASE_SECONDS:
        reporter = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
        if reporter is not None:
            reporter.write_line(f"[slow: {report.when} {report.duration:.0f} s, at {time.monotonic() - _session_started:.0f} s"
                                f" into the session] {report.nodeid} {report.outcome}")
