"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/); vllm_src and
vllm_gaudi_src come from the repository's root conftest.py."""
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
def port_dir() -> Path:
    return PORT
