"""inkling_hpu: Inkling-Small (text only) for vLLM 0.30.0 + vllm-gaudi.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it once in every process (API
server, engine core, each worker). It must stay cheap and must not import Habana modules: the
model class is registered as a lazy "module:Class" string and imported only when vLLM builds it.
"""
from __future__ import annotations

import importlib.util
import logging

from inkling_hpu import model_loader, registry_names

__version__ = "0.1.0"

logger = logging.getLogger("vllm.inkling_hpu")   # vLLM's handler prints it

# vllm-gaudi's general plugins, in the order its setup.py lists them (entry points are not sorted
# by vLLM, so ours may run first). Each is import-cached or guarded, so calling it again is a no-op.
_GAUDI_PLUGIN_FUNCTIONS = ("register_utils", "register_ops", "register_models")


def _on_vllm_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _register_vllm_gaudi_first() -> bool:
    """Run vllm-gaudi's general plugins before ours, when vllm-gaudi is installed and the platform is not
    vLLM's CPU platform (an image with vllm-gaudi serving on CPU: its plugins import Habana's modules)."""
    if importlib.util.find_spec("vllm_gaudi") is None or _on_vllm_cpu_platform():
        return False
    import vllm_gaudi

    for name in _GAUDI_PLUGIN_FUNCTIONS:
        getattr(vllm_gaudi, name)()
    return True


def _model_target(with_gaudi: bool) -> str:
    """The HPU glue, or the CPU glue on vLLM's CPU platform without vllm-gaudi's plugins."""
    if not with_gaudi and _on_vllm_cpu_platform():
        return registry_names.CPU_LAZY_TARGET
    return registry_names.LAZY_TARGET


def _register_models(target: str) -> None:
    from vllm import ModelRegistry

    for arch in registry_names.ARCHITECTURES:
        ModelRegistry.register_model(arch, target)


def _install_config_guard(runtime) -> None:
    """Run the start-up guards when vLLM builds a VllmConfig for an Inkling architecture.

    VllmConfig.__post_init__ calls MODELS_CONFIG_MAP[architecture].verify_and_update_config (vLLM's
    per-architecture config hook), in the API server before any weight is read, so a refused
    configuration fails in seconds rather than after a 532 GB load.
    """
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from inkling_hpu import guards

    for arch in registry_names.ARCHITECTURES:
        previous = MODELS_CONFIG_MAP.get(arch)
        if previous is not None and getattr(previous, "inkling_hpu_guard", False):
            continue  # already installed in this process

        class InklingHpuConfigGuard(VerifyAndUpdateConfig):
            inkling_hpu_guard = True
            _previous = previous

            @classmethod
            def verify_and_update_config(cls, vllm_config) -> None:
                if cls._previous is not None:
                    cls._previous.verify_and_update_config(vllm_config)
                guards.check(guards.settings_from_vllm_config(vllm_config, gaudi_runtime_config=runtime))
                _check_parallel_sizes(vllm_config)
                _check_tokenizer(vllm_config)
                model_loader.choose(vllm_config)

        MODELS_CONFIG_MAP[arch] = InklingHpuConfigGuard


def _check_parallel_sizes(vllm_config) -> None:
    """Refuse, once and in the API server, a tensor-parallel size the model cannot split or more pipeline
    stages than layers (each worker would otherwise fail building its layers)."""
    from inkling_hpu import guards
    from inkling_hpu.model.config import InklingPortConfig

    config = InklingPortConfig.from_object(vllm_config.model_config.hf_config)
    parallel = vllm_config.parallel_config
    refusal = (guards.tensor_parallel_refusal(config, parallel.tensor_parallel_size)
               or guards.pipeline_parallel_refusal(config, parallel.pipeline_parallel_size))
    if refusal:
        raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + refusal)


def _check_tokenizer(vllm_config) -> None:
    """Refuse --skip-tokenizer-init in the API server: vLLM then checks no prompt token id (the workers'
    token-id guard refuses it too, but vLLM's reasoning config fails on the missing tokenizer before them)."""
    from inkling_hpu import guards

    if vllm_config.model_config.skip_tokenizer_init:
        raise guards.InklingConfigRefused("Inkling-Small refuses to start: " + guards.NO_TOKENIZER)


def register() -> None:
    """vLLM general plugin: register Inkling's HPU model class, its loader, guards and parsers."""
    from inkling_hpu import guards

    with_gaudi = _register_vllm_gaudi_first()
    model_loader.register()
    target = _model_target(with_gaudi)
    _register_models(target)
    # On vLLM's CPU worker, contiguous PA and merged prefill do not exist; on HPU they are read from
    # vllm-gaudi's environment rules (the API server has no vllm-gaudi runtime config yet).
    _install_config_guard(guards.CPU_RUNTIME if target == registry_names.CPU_LAZY_TARGET else None)
    from inkling_hpu import parsers

    parsers.register()
    logger.debug("inkling_hpu registered %s -> %s (vllm-gaudi plugins %s)", registry_names.ARCHITECTURES,
                 target, "run first" if with_gaudi else "not run")
