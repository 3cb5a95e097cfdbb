"""habana_stub: habana_frameworks.torch.internal."""
from . import bridge_config  # noqa: F401
