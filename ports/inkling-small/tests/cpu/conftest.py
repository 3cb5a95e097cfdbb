"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/); vllm_src and
vllm_gaudi_src come from the repository's root conftest.py. inkling_hpu, cookbook and gaudi_harness
are importable through the root pyproject.toml's pytest pythonpath."""
from __future__ import annotations

from pathlib import Path

import pytest

from vllm_platform_pin import pin_vllm_to_its_pure_python_layers

PORT = Path(__file__).resolve().parents[2]          # ports/inkling-small


# before anything else of vLLM is imported (vllm_platform_pin.py says why)
pin_vllm_to_its_pure_python_layers()


@pytest.fixture(scope="session")
def port_dir() -> Path:
    return PORT


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    """A real CPU server with the recipe's CPU variant on the tiny Inkling, one per test module that asks for
    it (started before the module's first test, stopped after its last: one server at a time)."""
    from cpu_server_helpers import prepared

    srv = prepared(tmp_path_factory.mktemp(request.module.__name__) / "server.log")
    with srv:
        yield srv


@pytest.fixture(scope="session")
def served_vllm_gaudi(vllm_gaudi_src, tmp_path_factory) -> Path:
    """vllm-gaudi with the v0.30.0 profile's default fixes and the port's runner patches, as the page's
    image serves it (resumed-prefill-logits matters here: without it a request resumed after
    preemption samples from an old prompt row)."""
    from cookbook import api
    from gaudi_harness.compare import patched_tree

    profile = api.load_profile(api.DEFAULT_PROFILE)
    tree = patched_tree(vllm_gaudi_src, list(profile.fixes), tmp_path_factory.mktemp("served_vllm_gaudi"))
    port = api.load_profile(str(PORT / "patches" / "port.yaml"))
    api.apply_unpinned(port, {"vllm-gaudi": tree}, list(port.fixes))
    return tree
