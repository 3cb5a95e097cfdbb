"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/); vllm_src and
vllm_gaudi_src come from the repository's root conftest.py. inkling_hpu, cookbook and gaudi_harness
are importable through the root pyproject.toml's pytest pythonpath."""
from __future__ import annotations

from pathlib import Path

import pytest

PORT = Path(__file__).resolve().parents[2]          # ports/inkling-small


@pytest.fixture(scope="session")
def port_dir() -> Path:
    return PORT
