"""TEST-ONLY STAND-IN: lets vLLM 0.30.0's CPU workers take Ray "GPU" slots, for the two-node rehearsal on
CPU (tools/ray_nodes.py). Never shipped in the image or the recipe: on Gaudi, vllm-gaudi's HPU platform
declares its own Ray device ("HPU").

vLLM's CPU platform has no Ray device (`ray_device_key` is empty), so its Ray executor refuses to start.
Every process of the rehearsal (the API server, the engine core, each raylet's workers) has this folder on
PYTHONPATH, exported before `ray start` so that the raylets' workers inherit it, and Python imports this
file at start-up. It changes nothing until `vllm.platforms.cpu` is imported, then sets its platform's
`ray_device_key` to "GPU": the nodes are started with `--num-gpus`, one slot per worker, and vLLM's
executor asks each actor for one (`num_gpus=1`). No device is used: Ray's CUDA_VISIBLE_DEVICES means
nothing to the CPU worker.
"""
import importlib.abc
import sys

_TARGET = "vllm.platforms.cpu"


class _StandIn(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            from importlib.util import find_spec
            spec = find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_declare(module):
            exec_module(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_and_declare
        return spec


sys.meta_path.insert(0, _StandIn())
