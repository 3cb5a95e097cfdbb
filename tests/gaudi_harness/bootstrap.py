"""Make vllm-gaudi importable and runnable on CPU, in this process, before anything imports it.

Call `install()` first thing in a scenario process whose PYTHONPATH holds (in this order) the
directory above `gaudi_harness`, a vllm-gaudi tree and the vLLM 0.30.0 sdist tree (see
`gaudi_harness.subproc.harness_env`). It puts the habana_frameworks stub on sys.path and applies the
CPU shims; each shim is named and says why it is needed.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HABANA_STUB_DIR = Path(__file__).resolve().parent / "habana_stub"
ENTRY_POINTS_DIR = Path(__file__).resolve().parent / "entry_points"

_installed = False


def install() -> None:
    """Idempotent. Order matters: env and stub before the first vllm / vllm_gaudi import."""
    global _installed
    if _installed:
        return
    _require_env()
    import habana_frameworks.torch  # noqa: F401  (registers torch.hpu, as the real package does)

    _check_hpu_platform()
    _shim_pin_memory_off()
    _shim_pinned_tensor_literals()
    _compat_group_mm_kwargs_by_modality()
    _shim_h2d_default_device_cpu()
    _installed = True


def _require_env() -> None:
    """These must be in the environment before the process starts (vLLM reads some at import)."""
    expected = {"VLLM_USE_FAKE_HPU": "1", "VLLM_TARGET_DEVICE": None}
    wrong = {k: os.environ.get(k) for k, v in expected.items() if os.environ.get(k) != v}
    missing = [p for p in (HABANA_STUB_DIR, ENTRY_POINTS_DIR) if str(p) not in sys.path]
    if missing:
        raise RuntimeError(f"gaudi_harness: {missing} must be on PYTHONPATH (use harness_env)")
    if wrong:
        raise RuntimeError(f"gaudi_harness needs environment {expected}, found {wrong}: start the process "
                           "with gaudi_harness.subproc.harness_env(...)")


def _check_hpu_platform() -> None:
    """vLLM's own plugin loader activated vllm_gaudi (entry points from entry_points/, as in a Gaudi
    install): HpuPlatform is current and the deferred HPU patches are installed."""
    import vllm.platforms as platforms
    import vllm.plugins

    name = type(platforms.current_platform).__name__
    if name != "HpuPlatform":
        raise RuntimeError(f"gaudi_harness: expected HpuPlatform as the current platform, found {name}: "
                           "is entry_points/ on PYTHONPATH and VLLM_TARGET_DEVICE unset?")
    vllm.plugins.load_general_plugins()  # register_utils + vllm_gaudi.patches' deferred patches


def _shim_pin_memory_off() -> None:
    """Without the HPU platform active vLLM resolves UnspecifiedPlatform, whose
    is_pin_memory_available() is True; pinning needs an accelerator, so turn it off."""
    import vllm.utils.torch_utils as torch_utils

    torch_utils.PIN_MEMORY = False
    try:
        import vllm.v1.sample.ops.penalties as penalties
        penalties.PIN_MEMORY = False
    except ImportError:
        pass
    import vllm.utils.platform_utils as platform_utils
    platform_utils.is_pin_memory_available = lambda: False


def _shim_pinned_tensor_literals() -> None:
    """vllm-gaudi writes torch.tensor(..., pin_memory=True) literally (apply_grammar_bitmask); a
    Gaudi host has a pinned-memory allocator, CPU-only torch has none and raises. On CPU pinning
    changes nothing observable, so torch.tensor ignores pin_memory here."""
    import torch

    if getattr(torch.tensor, "_gaudi_harness_shim", False):
        return
    real_tensor = torch.tensor

    def tensor(*args, pin_memory=False, **kwargs):
        return real_tensor(*args, **kwargs)

    tensor._gaudi_harness_shim = True
    torch.tensor = tensor


def compat_group_mm_kwargs_by_modality(*args, **kwargs):
    """API drift shim: vllm-gaudi main imports this name, vLLM 0.30.0 renamed it to
    group_and_batch_mm_kwargs. The CPU harness never runs multimodal inputs."""
    raise NotImplementedError("gaudi_harness: multimodal inputs are not supported on the CPU harness "
                              "(group_mm_kwargs_by_modality is an import-compatibility shim only)")


def _compat_group_mm_kwargs_by_modality() -> None:
    """hpu_model_runner.py imports vllm.multimodal.utils.group_mm_kwargs_by_modality, absent from
    vLLM 0.30.0: provide the name so main's runner imports against 0.30.0 (releases/v0.30.0 of
    vllm-gaudi, not public, must differ there). Never part of a patch."""
    import vllm.multimodal.utils as mm_utils

    if not hasattr(mm_utils, "group_mm_kwargs_by_modality"):
        mm_utils.group_mm_kwargs_by_modality = compat_group_mm_kwargs_by_modality


def _shim_h2d_default_device_cpu() -> None:
    """vllm_gaudi.utils.async_h2d_update/async_h2d_copy default to device="hpu" and the input batch
    calls them without device=: point the default at "cpu" (the functions themselves are real)."""
    import vllm_gaudi.utils as gaudi_utils

    for fn in (gaudi_utils.async_h2d_update, gaudi_utils.async_h2d_copy):
        defaults = list(fn.__defaults__ or ())
        if defaults and defaults[-1] == "hpu":
            defaults[-1] = "cpu"
            fn.__defaults__ = tuple(defaults)
