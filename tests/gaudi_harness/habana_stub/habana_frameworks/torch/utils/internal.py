"""habana_stub: execution mode query."""


def is_lazy() -> bool:
    """The stub runs eagerly (vllm_gaudi/utils.py asks at import time)."""
    return False
