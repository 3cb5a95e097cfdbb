"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

PORT = Path(__file__).resolve().parents[2]          # ports/inkling-small
REPO = PORT.parents[1]                              # repository root (cookbook/)
for path in (PORT, REPO):
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
