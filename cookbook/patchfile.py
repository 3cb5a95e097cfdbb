"""Reading a git-format patch: the files it touches, their blob ids, and whether its paths are safe.

Parsing is for metadata and safety only; applying is always `git apply` (zero fuzz, atomic).
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import unidiff

from .errors import FixRefused

_DIFF_GIT = re.compile(r"^diff --git (\S+) (\S+)$")
_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: \d+)?$")
_NULL_BLOB = "0" * 40


@dataclass(frozen=True)
class FileChange:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    pre_blob: str | None
    post_blob: str | None

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.old_path, self.new_path) if p]


@dataclass(frozen=True)
class ParsedPatch:
    path: Path
    text: bytes
    changes: list[FileChange]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text).hexdigest()

    @property
    def touched(self) -> list[str]:
        return sorted({p for c in self.changes for p in c.paths})


def blob_id(data: bytes) -> str:
    """git's object id for a blob with these bytes (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _strip_prefix(path: str, prefix: str) -> str | None:
    if path == "/dev/null":
        return None
    if not path.startswith(prefix):
        raise ValueError(f"path {path!r} lacks the {prefix!r} prefix")
    return path[len(prefix):]


def parse(path: Path) -> ParsedPatch:
    """Parse a patch file, refusing anything malformed (with the reason)."""
    text = path.read_bytes()
    try:
        decoded = text.decode("utf-8")
        unidiff.PatchSet(decoded)  # well-formed hunks and line counts
    except (UnicodeDecodeError, unidiff.UnidiffParseError) as exc:
        raise FixRefused(f"malformed patch {path}: {exc}") from None
    changes: list[FileChange] = []
    current: dict | None = None

    def flush():
        if current is not None:
            changes.append(FileChange(current["old"], current["new"], current["pre"], current["post"]))

    try:
        for line in decoded.splitlines():
            m = _DIFF_GIT.match(line)
            if m:
                flush()
                current = {"old": _strip_prefix(m.group(1), "a/"), "new": _strip_prefix(m.group(2), "b/"),
                           "pre": None, "post": None}
                continue
            if current is None:
                continue
            if line.startswith("new file mode"):
                current["old"] = None
            elif line.startswith("deleted file mode"):
                current["new"] = None
            elif line.startswith(("rename from ", "copy from ")):
                current["old"] = line.split(" ", 2)[2]
            elif line.startswith(("rename to ", "copy to ")):
                current["new"] = line.split(" ", 2)[2]
            elif line.startswith("--- "):
                current["old"] = _strip_prefix(line[4:].split("\t")[0], "a/")
            elif line.startswith("+++ "):
                current["new"] = _strip_prefix(line[4:].split("\t")[0], "b/")
            else:
                m = _INDEX.match(line)
                if m:
                    current["pre"] = None if m.group(1) == _NULL_BLOB else m.group(1)
                    current["post"] = None if m.group(2) == _NULL_BLOB else m.group(2)
        flush()
    except ValueError as exc:
        raise FixRefused(f"malformed patch {path}: {exc}") from None
    if not changes:
        raise FixRefused(f"malformed patch {path}: no `diff --git` file sections")
    for change in changes:
        if (change.pre_blob and len(change.pre_blob) != 40) or (change.post_blob and len(change.post_blob) != 40):
            raise FixRefused(f"malformed patch {path}: index lines must carry full blob ids "
                             "(make it with `git diff --full-index`)")
    return ParsedPatch(path=path, text=text, changes=changes)


def check_paths(patch: ParsedPatch, root: Path, package: str) -> None:
    """Refuse a patch that could write outside `root/package`, before anything is written."""
    package_dir = os.path.realpath(root / package)
    for rel in patch.touched:
        pure = PurePosixPath(rel)
        reason = None
        if pure.is_absolute() or rel.startswith("/"):
            reason = "is absolute"
        elif ".." in pure.parts:
            reason = "contains '..'"
        elif "\\" in rel:
            reason = "contains a backslash"
        elif not pure.parts or pure.parts[0] != package:
            reason = f"is outside the target package {package}/"
        else:
            real = os.path.realpath(root / rel)
            if not real.startswith(package_dir + os.sep):
                reason = f"resolves through a symlink to {real}, outside {package_dir}"
        if reason:
            raise FixRefused(f"{patch.path}: path {rel!r} {reason}; refusing before any write")
