"""habana_stub: habana_frameworks.torch on CPU.

The real package registers the `torch.hpu` module on import; so does this stub (vllm-gaudi annotates
`torch.hpu.Stream` at class-definition time). `habana_frameworks.torch.torch` is the real torch.
"""
import sys

import torch

from . import core, hpex, hpu, internal, utils  # noqa: F401  (imported for attribute access: htorch.core...)
from . import stand_in_ops  # noqa: F401  (registers torch.ops.hpu.*, as the real package does on import)

if not hasattr(torch, "hpu") or sys.modules.get("torch.hpu") is not hpu:
    sys.modules["torch.hpu"] = hpu
    torch.hpu = hpu


def _register_hpu_backend() -> None:
    """The real package registers the torch.compile backend "hpu_backend" on import; vllm-gaudi's
    platform names it as vLLM's simple_compile_backend. Here it runs the graph eagerly."""
    from torch._dynamo import list_backends, register_backend

    if "hpu_backend" not in list_backends(exclude_tags=()):

        @register_backend(name="hpu_backend")
        def hpu_backend(graph_module, example_inputs):  # noqa: ARG001
            return graph_module.forward


_register_hpu_backend()
