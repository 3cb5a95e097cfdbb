"""habana_stub: bridge configuration (used only by the runner's warm-up, which cannot run on CPU)."""
import contextlib


@contextlib.contextmanager
def env_setting(name: str, value) -> "contextlib.AbstractContextManager[None]":
    """Temporarily set a bridge option: no bridge on CPU, so nothing changes."""
    yield
