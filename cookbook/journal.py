"""All-or-nothing writes to one or more source trees: a lock per tree, and a journal of the
original bytes from which an interrupted run (even SIGKILL) is undone by the next run.

Layout: the journal of a run lives in its first root, `<root>/.cookbook-fixes-journal/`
(backups + manifest.json). Every other root touched by the run holds a pointer file naming that
journal, written before anything else. A journal directory only takes its final name once complete
(atomic rename), so a journal either lists every file the run may change, or does not exist yet and
nothing has been changed.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

from .errors import FixRefused

JOURNAL = ".cookbook-fixes-journal"
POINTER = ".cookbook-fixes-journal-ref"
# Fault injection for the crash tests only: SIGKILL this process after N file writes.
FAULT_ENV = "COOKBOOK_TEST_KILL_AFTER_WRITES"


def _unique_roots(roots) -> list[Path]:
    return sorted({Path(os.path.realpath(r)) for r in roots})


@contextmanager
def locked(roots):
    """Serialise runs on the same trees (locks taken in a fixed order: no deadlock).

    The lock is taken on the tree's directory itself, so a run leaves no lock file behind."""
    with ExitStack() as stack:
        for root in _unique_roots(roots):
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
            stack.callback(os.close, fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"waiting for another fix-pack run on {root} to finish…", file=sys.stderr)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield


def _write_bytes(path: Path, data: bytes, mode: int) -> None:
    """Replace a file's bytes atomically (temp file + rename), with the given mode."""
    tmp = _temp_name(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.cookbook-tmp")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _remove_empty_parents(folder: Path, roots) -> None:
    """Like git, a deleted file takes its folders with it once they are empty (never a root)."""
    stop = {Path(os.path.realpath(r)) for r in roots}
    while Path(os.path.realpath(folder)) not in stop:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _restore(journal: Path) -> list[str]:
    manifest = json.loads((journal / "manifest.json").read_text())
    restored = []
    for entry in manifest["files"]:
        path = Path(entry["path"])
        if entry["backup"] is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            _write_bytes(path, (journal / entry["backup"]).read_bytes(), entry["mode"])
        _temp_name(path).unlink(missing_ok=True)  # a write killed between open and rename
        restored.append(str(path))
    for folder in manifest.get("created_dirs", []):  # deepest first
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty or already gone
    for pointer in manifest["pointers"]:
        Path(pointer).unlink(missing_ok=True)
    _discard(journal)
    return restored


def _discard(journal: Path) -> None:
    doomed = journal.with_name(journal.name + f".done-{os.getpid()}")
    os.rename(journal, doomed)  # atomic: the journal stops counting before it is deleted
    shutil.rmtree(doomed)


def recover(roots) -> list[str]:
    """Undo an interrupted run found in these trees; returns the files restored."""
    restored: list[str] = []
    for root in _unique_roots(roots):
        for leftover in root.glob(JOURNAL + ".*"):  # incomplete or already-discarded journals
            shutil.rmtree(leftover, ignore_errors=True)
        pointer = root / POINTER
        if pointer.exists():
            journal = Path(pointer.read_text().strip())
            if (journal / "manifest.json").exists():
                restored += _restore(journal)
            pointer.unlink(missing_ok=True)
        if (root / JOURNAL / "manifest.json").exists():
            restored += _restore(root / JOURNAL)
        elif (root / JOURNAL).exists():  # not one of ours in a state we write: nothing it can undo
            shutil.rmtree(root / JOURNAL)
    return restored


def check_writable(changes) -> None:
    """Refuse, before any write, files marked read-only and folders that cannot be written."""
    for path in changes:
        if path.exists() and not os.stat(path).st_mode & 0o222:
            raise FixRefused(f"{path} is read-only; refusing before any write")
        folder = _existing_ancestor(path.parent)
        if not os.access(folder, os.W_OK):
            raise FixRefused(f"{folder} is not writable; refusing before any write")


def commit(roots, changes: dict[Path, tuple[bytes, int] | None]) -> None:
    """Write `changes` (absolute path -> (new bytes, mode), None to delete) all or nothing."""
    roots = _unique_roots(roots)
    check_writable(changes)
    primary = roots[0]
    journal = primary / JOURNAL
    pointers = [str(r / POINTER) for r in roots[1:]]
    for pointer in pointers:
        Path(pointer).write_text(str(journal) + "\n")
    staging = primary / (JOURNAL + f".tmp-{os.getpid()}")
    staging.mkdir()
    entries, created_dirs = [], set()
    for index, path in enumerate(sorted(changes)):
        if path.exists():
            shutil.copyfile(path, staging / str(index))
            entries.append({"path": str(path), "backup": str(index), "mode": os.stat(path).st_mode & 0o7777})
        else:
            entries.append({"path": str(path), "backup": None})
            folder = path.parent
            while not folder.exists():
                created_dirs.add(str(folder))
                folder = folder.parent
    with open(staging / "manifest.json", "w") as fh:
        json.dump({"files": entries, "pointers": pointers,
                   "created_dirs": sorted(created_dirs, key=len, reverse=True)}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(staging, journal)  # from here on, the journal can undo everything below

    kill_after = int(os.environ.get(FAULT_ENV, "0") or 0)
    try:
        for written, entry in enumerate(entries, start=1):
            path = Path(entry["path"])
            new = changes[path]
            if new is None:
                path.unlink(missing_ok=True)
                _remove_empty_parents(path.parent, roots)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_bytes(path, *new)
            if kill_after and written >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    except BaseException:
        _restore(journal)
        raise
    _discard(journal)
    for pointer in pointers:
        Path(pointer).unlink(missing_ok=True)
