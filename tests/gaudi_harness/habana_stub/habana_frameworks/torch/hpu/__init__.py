"""habana_stub: the `torch.hpu` device module, reduced to CPU no-ops.

Streams and events exist because the runner builds them in __init__ (async output copy); on CPU all
work is synchronous, so they only need to behave as context managers / record-wait no-ops.
"""
import contextlib

from . import metrics  # noqa: F401


def wrap_in_hpu_graph(module, *args, **kwargs):
    """HPU graphs do not exist on CPU: the module runs as is."""
    return module


def synchronize(*args, **kwargs) -> None:
    """CPU work is synchronous."""


def is_available() -> bool:
    return False


def device_count() -> int:
    return 0


def mem_get_info(*args, **kwargs) -> tuple[int, int]:
    """(free, total) bytes; a fixed 1 GiB so memory profiling arithmetic works."""
    return (1 << 30, 1 << 30)


class Event:

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class Stream:

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or Event()


_default_stream = Stream()


def current_stream(*args, **kwargs) -> Stream:
    return _default_stream


@contextlib.contextmanager
def stream(s=None):
    yield s
