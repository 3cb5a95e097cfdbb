"""vLLM's model loader for Inkling (load format `inkling_text`), chosen by the port's config hook
when --load-format is `auto`.

The port's `load_weights` reads its text tensors itself (this rank's slabs only, vision/audio/MTP
never) and leaves vLLM's weight iterator unstarted. vLLM's default loader times the load from the
iterator's first pull, so with the port it would report the seconds since the process started
("Loading weights took 666.68 seconds" for a sub-second load). This loader is vLLM's default loader
(download, model construction, post-processing) with the load itself timed around the port's own.
"""
from __future__ import annotations

import logging
import time

LOAD_FORMAT = "inkling_text"

logger = logging.getLogger("vllm.inkling_hpu")


def register() -> None:
    """Register the loader with vLLM (every process: the workers build the model)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    if LOAD_FORMAT in _LOAD_FORMAT_TO_MODEL_LOADER:
        return

    @register_model_loader(LOAD_FORMAT)
    class InklingTextLoader(DefaultModelLoader):
        def load_weights(self, model, model_config) -> None:
            start = time.perf_counter()
            model.load_weights(iter(()))
            logger.info("Loading weights took %.2f seconds (the port's text-only load)", time.perf_counter() - start)


def choose(vllm_config) -> None:
    """--load-format auto -> the port's loader; any format the user named is left as it is."""
    if vllm_config.load_config.load_format == "auto":
        vllm_config.load_config.load_format = LOAD_FORMAT
