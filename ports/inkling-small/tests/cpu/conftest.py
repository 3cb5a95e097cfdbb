"""Shared fixtures for the port's CPU tests (run by `make test` next to tests/); vllm_src and
vllm_gaudi_src come from the repository's root conftest.py. inkling_hpu, cookbook and gaudi_harness
are importable through the root pyproject.toml's pytest pythonpath."""
from __future__ import annotations

from pathlib import Path

import pytest

PORT = Path(__file__).resolve().parents[2]          # ports/inkling-small


def _pin_vllm_to_its_pure_python_layers() -> None:
    """The tests in this process build the port on vLLM's pure-Python layers: vLLM's UnspecifiedPlatform, what
    the sdist resolves to. An installed vLLM resolves otherwise (the CPU build to its CpuPlatform, a Gaudi
    image to vllm-gaudi's HPU platform, whose kernels the tests' CPU tensors cannot run), and the in-image
    preflight runs these tests against it: pinned, they compute the same there. The served path on a
    platform's kernels is what the server tests and the rehearsal container check; child processes (the
    harness, the servers, the CLIs) resolve their own platform.

    `import vllm` resolves the platform (vllm.utils.torch_utils asks it at import) and caches it in
    vllm.platforms._current_platform; no module imported by then holds it, so replacing the cache before
    anything else of vLLM is imported pins every later `from vllm.platforms import current_platform`."""
    import sys

    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    resolved = vllm.platforms.current_platform
    if resolved.is_unspecified():    # the sdist
        return
    holders = [name for name, module in list(sys.modules.items())
               if name != "vllm.platforms" and getattr(module, "current_platform", None) is resolved]
    if holders:
        raise RuntimeError(f"vLLM modules already hold the resolved platform ({', '.join(holders)}): the port's "
                           "CPU tests must be collected before the rest of vLLM is imported")
    vllm.platforms._current_platform = UnspecifiedPlatform()


_pin_vllm_to_its_pure_python_layers()


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
