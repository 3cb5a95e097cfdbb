"""habana_stub: habana_frameworks.torch.utils."""
from . import experimental, internal  # noqa: F401
