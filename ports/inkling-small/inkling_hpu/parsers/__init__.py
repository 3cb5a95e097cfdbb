"""Inkling tool-call and reasoning parsers (`inkling_py`), pure Python, for vLLM 0.30.0.

`register()` makes `--tool-call-parser inkling_py --reasoning-parser inkling_py` resolve to
them; the plugin's entry point calls it.
"""

from __future__ import annotations


def register() -> None:
    """Register the tool and reasoning parsers as "inkling_py" with vLLM's managers."""
    from inkling_hpu.parsers import inkling_py

    inkling_py.register()


__all__ = ["register"]
