"""habana_stub: HPU metrics (the profiler asks for graph-compilation counters)."""
import contextlib


@contextlib.contextmanager
def metric_localcontext(name: str):
    """No HPU metrics on CPU: yields an empty stats holder."""

    class _NoStats:

        def stats(self):
            return []

    yield _NoStats()
