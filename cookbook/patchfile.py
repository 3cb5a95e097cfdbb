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

_INDEX = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: (\d+))?$")
_NULL_BLOB = "0" * 40
# git's modes for a symbolic link and a submodule: neither is a file the fix pack may write.
_LINK_MODES = {"120000": "a symbolic link", "160000": "a submodule"}
_C_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}


@dataclass(frozen=True)
class Hunk:
    source_start: int
    source_length: int
    target_start: int
    target_length: int
    section_header: str

    def __str__(self) -> str:
        header = f" {self.section_header}" if self.section_header else ""
        return f"@@ -{self.source_start},{self.source_length} +{self.target_start},{self.target_length} @@{header}"


@dataclass(frozen=True)
class FileChange:
    old_path: str | None  # None: the patch creates the file
    new_path: str | None  # None: the patch deletes the file
    pre_blob: str | None
    post_blob: str | None
    new_mode: str | None = None  # "100644"/"100755" when the patch creates the file or changes its mode
    hunks: tuple[Hunk, ...] = ()

    @property
    def paths(self) -> list[str]:
        return [p for p in (self.old_path, self.new_path) if p]

    @property
    def changes_mode(self) -> bool:
        """An `old mode`/`new mode` pair: the patch sets the executable bit of an existing file."""
        return self.new_mode is not None and self.old_path is not None


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


def unquote_path(name: str) -> str:
    """A path as git writes it: as is, or C-quoted ("a/t\\303\\251st") when it has special bytes."""
    if not (len(name) >= 2 and name[0] == name[-1] == '"'):
        return name
    out, body, i = bytearray(), name[1:-1], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out += ch.encode()
            i += 1
        elif body[i + 1:i + 2] in _C_ESCAPES:
            out.append(_C_ESCAPES[body[i + 1]])
            i += 2
        elif re.fullmatch(r"[0-7]{3}", body[i + 1:i + 4]):
            out.append(int(body[i + 1:i + 4], 8))
            i += 4
        else:
            raise ValueError(f"bad escape in quoted path {name}")
    return out.decode("utf-8", "surrogateescape")


def _strip_prefix(path: str, prefix: str) -> str | None:
    path = unquote_path(path.rstrip("\t"))  # git ends a name holding a space with a tab
    if path == "/dev/null":
        return None
    if not path.startswith(prefix):
        raise ValueError(f"path {path!r} lacks the {prefix!r} prefix")
    return path[len(prefix):]


def _file_change(pfile: unidiff.PatchedFile) -> FileChange:
    """One file section: names as unidiff read them (spaces and quoting as git writes them), blob
    ids and modes from its extended header lines."""
    old, new = _strip_prefix(pfile.source_file, "a/"), _strip_prefix(pfile.target_file, "b/")
    pre = post = mode = None
    for line in str(pfile.patch_info).splitlines():
        if m := _INDEX.match(line):
            pre = None if m.group(1) == _NULL_BLOB else m.group(1)
            post = None if m.group(2) == _NULL_BLOB else m.group(2)
            modes = [m.group(3)]
        else:
            word, _, value = line.rpartition(" ")
            if word not in ("new file mode", "deleted file mode", "old mode", "new mode"):
                continue
            if word == "new file mode":
                old = None
            elif word == "deleted file mode":
                new = None
            if word in ("new file mode", "new mode"):
                mode = value
            modes = [value]
        for value in modes:
            if value in _LINK_MODES:
                raise ValueError(f"{new or old} is {_LINK_MODES[value]} (mode {value}); the fix pack "
                                 "writes regular files only")
    if pfile.is_added_file:
        old = None
    if pfile.is_removed_file:
        new = None
    hunks = tuple(Hunk(h.source_start, h.source_length, h.target_start, h.target_length, h.section_header)
                  for h in pfile)
    return FileChange(old, new, pre, post, mode, hunks)


def parse(path: Path) -> ParsedPatch:
    """Parse a patch file, refusing anything malformed or unsafe to write (with the reason)."""
    text = path.read_bytes()
    try:
        changes = [_file_change(pfile) for pfile in unidiff.PatchSet(text.decode("utf-8"))]
    except (UnicodeDecodeError, unidiff.UnidiffParseError, ValueError) as exc:
        raise FixRefused(f"malformed patch {path}: {exc}") from None
    if not changes:
        raise FixRefused(f"malformed patch {path}: no `diff --git` file sections")
    for change in changes:
        if (change.pre_blob and len(change.pre_blob) != 40) or (change.post_blob and len(change.post_blob) != 40):
            raise FixRefused(f"malformed patch {path}: index lines must carry full blob ids "
                             "(make it with `git diff --full-index`)")
    return ParsedPatch(path=path, text=text, changes=changes)


_NAMED = re.compile(r"^(---|\+\+\+|rename from|rename to) (.+?)\t?$", re.M)


def paths_named(text: bytes) -> set[str]:
    """Every path a patch's file headers name, read leniently (a malformed patch still lists what
    it would touch): for identifying a tree by content before any patch is parsed."""
    names = set()
    for kind, name in _NAMED.findall(text.decode("utf-8", "replace")):
        try:
            name = unquote_path(name)
        except ValueError:
            continue
        if kind in ("---", "+++"):
            if name == "/dev/null" or name[:2] not in ("a/", "b/"):
                continue
            name = name[2:]
        names.add(name)
    return names


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
        elif os.path.islink(root / rel):
            reason = f"is a symbolic link to {os.readlink(root / rel)}; the fix pack writes regular files only"
        else:
            real = os.path.realpath(root / rel)
            if not real.startswith(package_dir + os.sep):
                reason = f"resolves through a symlink to {real}, outside {package_dir}"
        if reason:
            raise FixRefused(f"{patch.path}: path {rel!r} {reason}; refusing before any write")
