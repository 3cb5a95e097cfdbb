"""Tensor names of the TML Inkling checkpoint: which the text-only port reads, and name templates.

The checkpoint holds the text backbone (`model.llm.*`) and, never read by the port, the vision
tower (`model.visual.*`), the audio tower (`model.audio.*`) and the MTP draft head (`model.mtp.*`).
The loader (inkling_hpu.loader) and the model's name table (inkling_hpu.model.weights) both use
this module; it imports neither.
"""
from __future__ import annotations

import re

TEXT_PREFIX = "model.llm."
# The towers and the MTP head: never read.
SKIPPED_PREFIXES = ("model.visual.", "model.audio.", "model.mtp.")


def is_skipped(name: str) -> bool:
    """A vision/audio tower or MTP tensor: the text-only port never reads its bytes."""
    return name.startswith(SKIPPED_PREFIXES)


def template_regex(template: str) -> re.Pattern:
    """The whole-name pattern of a name template whose `{i}` (the layer index) is captured as group `i`."""
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")
