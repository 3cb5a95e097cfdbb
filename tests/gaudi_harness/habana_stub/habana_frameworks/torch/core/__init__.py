"""habana_stub: graph/lazy-mode controls; on CPU there is no lazy graph, so these do nothing."""


def mark_step(*args, **kwargs) -> None:
    """Lazy-mode graph cut: nothing to flush on CPU."""


def hpu_inference_set_env(*args, **kwargs) -> None:
    """Inference env set-up for quantized models: nothing to set on CPU."""


def hpu_initialize(*args, **kwargs) -> None:
    """Marks scales as constants on HPU: nothing to do on CPU."""
