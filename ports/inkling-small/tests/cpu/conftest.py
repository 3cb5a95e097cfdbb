"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

PORT = Path(__file__).resolve().parents[2]          # ports/inkling-small
REPO = PORT.parents[1]                              # repository root (cookbook/)
# REPO/tests holds gaudi_harness (the CPU harness for vllm-gaudi code).
for path in (PORT, REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def vllm_src() -> Path:
    """Pristine vLLM v0.30.0 sdist tree (sha256-pinned, cached). Never modify it."""
    from cookbook import upstream

    return upstream.vllm_source("0.30.0")


@pytest.fixture(scope="session")
def port_dir() -> Path:
    return PORT


@pytest.fixture(scope="session")
def vllm_gaudi_src() -> Path:
    """A vllm-gaudi source tree named by VLLM_GAUDI_SRC (main 091bbadd); skips when unset."""
    import os

    src = os.environ.get("VLLM_GAUDI_SRC")
    if not src:
        pytest.skip("VLLM_GAUDI_SRC is not set: no vllm-gaudi source tree to test against")
    path = Path(src)
    if not (path / "vllm_gaudi").is_dir():
        pytest.fail(f"VLLM_GAUDI_SRC={src} has no vllm_gaudi/ package directory")
    return path
