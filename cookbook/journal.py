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
    """Replace a file's bytes atomically (temp file + rename), keeping its mode."""
    tmp = path.with_name(f".{path.name}.cookbook-tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _restore(journal: Path) -> list[str]:
    manifest = json.loads((journal / "manifest.json").read_text())
    restored = []
    for entry in manifest["files"]:
        path = Path(entry["path"])
        if entry["backup"] is None:
            if path.exists():
                path.unlink()
        else:
            _write_bytes(path, (journal / entry["backup"]).read_bytes(), entry["mode"])
        restored.append(str(path))
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
    return restored


def commit(roots, changes: dict[Path, bytes | None]) -> None:
    """Write `changes` (absolute path -> new bytes, None to delete) all or nothing."""
    roots = _unique_roots(roots)
    for path in changes:
        if path.exists() and not os.stat(path).st_mode & 0o222:
            raise FixRefused(f"{path} is read-only; refusing before any write")
        if not os.access(path.parent, os.W_OK):
            raise FixRefused(f"{path.parent} is not writable; refusing before any write")
    primary = roots[0]
    journal = primary / JOURNAL
    pointers = [str(r / POINTER) for r in roots[1:]]
    for pointer in pointers:
        Path(pointer).write_text(str(journal) + "\n")
    staging = primary / (JOURNAL + f".tmp-{os.getpid()}")
    staging.mkdir()
    entries = []
    for index, path in enumerate(sorted(changes)):
        if path.exists():
            shutil.copyfile(path, staging / str(index))
            entries.append({"path": str(path), "backup": str(index), "mode": os.stat(path).st_mode & 0o7777})
        else:
            entries.append({"path": str(path), "backup": None, "mode": 0o644})
    with open(staging / "manifest.json", "w") as fh:
        json.dump({"files": entries, "pointers": pointers}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(staging, journal)  # from here on, the journal can undo everything below

    kill_after = int(os.environ.get(FAULT_ENV, "0") or 0)
    try:
        for written, entry in enumerate(entries, start=1):
            path, data = Path(entry["path"]), changes[Path(entry["path"])]
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_bytes(path, data, entry["mode"])
            if kill_after and written >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
    except BaseException:
        _restore(journal)
        raise
    _discard(journal)
    for pointer in pointers:
        Path(pointer).unlink(missing_ok=True)
