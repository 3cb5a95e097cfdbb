"""All-or-nothing writes to one or more packages: a lock per package, and a journal of the
original bytes from which an interrupted run (even SIGKILL, even power loss) is undone or finished
by the next.

A "tree" here is a package's real directory (`vllm/` or `vllm_gaudi/` with every symbolic link
resolved), so every path that reaches the same files takes the same lock and finds the same journal.
Each tree a run changes gets its own journal, `<package>/.cookbook-fixes-journal/` (backups +
manifest.json), holding paths relative to that package only: a journal restores into the tree it is
found in, wherever that tree has been moved or copied since.

The protocol, for a run over one or more trees:
1. Every tree's journal is written under a staging name and renamed into place (then the folder is
   fsynced) before the first file is written: a tree holds its old files, or a journal.
2. The files are written (each to a temporary name, fsynced, renamed) and their folders fsynced.
3. Commit point: every journal of the run gets a `committed` marker (fsynced), before any is discarded.
4. The journals are discarded.
Recovery of a journal: if it, or a journal of the same run in one of the run's other trees, carries
the marker, every file of the run was written: the run is finished (the other trees' journals are
discarded, or marked where another process holds that tree, then its own). Otherwise it is undone:
its tree restored, and the run's other trees where they still are and no other process holds them.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
import uuid
from contextlib import ExitStack, contextmanager
from pathlib import Path, PurePosixPath

from .errors import FixRefused

JOURNAL = ".cookbook-fixes-journal"
COMMITTED = "committed"
# Names a run gives its journal while writing it and while discarding it: always ours to remove.
_STAGING, _DONE = JOURNAL + ".tmp-", JOURNAL + ".done-"
# Fault injection for the crash tests only: SIGKILL this process after N file writes.
FAULT_ENV = "COOKBOOK_TEST_KILL_AFTER_WRITES"


def real_tree(package_dir) -> Path:
    """The directory that locks and journals the package: its real path."""
    return Path(os.path.realpath(package_dir))


def _unique_roots(roots) -> list[Path]:
    return sorted({real_tree(r) for r in roots})


def _try_lock(root: Path, stack: ExitStack, wait: bool) -> bool:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    stack.callback(os.close, fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not wait:
            return False
        print(f"waiting for another fix-pack run on {root} to finish…", file=sys.stderr)
        fcntl.flock(fd, fcntl.LOCK_EX)
    return True


@contextmanager
def locked(roots):
    """Serialise runs on the same trees (locks taken in a fixed order: no deadlock).

    The lock is taken on the tree's directory itself, so a run leaves no lock file behind."""
    with ExitStack() as stack:
        for root in _unique_roots(roots):
            _try_lock(root, stack, wait=True)
        yield


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.cookbook-tmp")


def _write_bytes(path: Path, data: bytes, mode: int, owner: tuple[int, int] | None = None) -> None:
    """Replace a file's bytes atomically and durably (temp file, fsync, rename), keeping its mode
    and, where this process may set it, its owner (as dpkg does)."""
    tmp = _temp_name(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(tmp, mode)
    if owner:
        try:
            os.chown(tmp, *owner)
        except PermissionError:
            pass  # not root: the file becomes ours, as with any editor
    os.replace(tmp, path)


def _existing_ancestor(path: Path) -> Path:
    while not os.path.lexists(path):
        path = path.parent
    return path


def _remove_empty_parents(folder: Path, root: Path) -> None:
    """Like git, a deleted file takes its folders with it once they are empty (never the root)."""
    while folder != root and root in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _inside(root: Path, rel: str) -> Path:
    """root/rel for a path a journal names, refusing one that would leave the root."""
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise FixRefused(f"{root / JOURNAL}: names {rel!r}, which is not a path inside {root}; "
                         "refusing to restore from it (inspect it, then remove it)")
    return root / rel


def _read_manifest(journal: Path) -> dict:
    try:
        manifest = json.loads((journal / "manifest.json").read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise ValueError("not a journal manifest")
    except (OSError, ValueError) as exc:
        raise FixRefused(f"{journal} has no readable manifest.json ({exc}): a fix-pack run never "
                         "leaves its journal in that state, so it cannot say what to restore; inspect "
                         "it, then remove it") from None
    return manifest


def _restore(root: Path, journal: Path, manifest: dict | None = None) -> list[str]:
    """Put back every file the journal lists, in the tree it was found in; then discard it."""
    manifest = manifest or _read_manifest(journal)
    restored = []
    for entry in manifest["files"]:
        path = _inside(root, entry["path"])
        if entry["backup"] is None:
            if path.is_file() or path.is_symlink():
                path.unlink()
        else:
            backup = (journal / entry["backup"]).read_bytes()
            if not (path.is_file() and os.stat(path).st_mode & 0o7777 == entry["mode"]
                    and path.read_bytes() == backup):  # a file the run had not reached yet
                path.parent.mkdir(parents=True, exist_ok=True)
                _write_bytes(path, backup, entry["mode"], tuple(entry["owner"]) if entry.get("owner") else None)
        if _temp_name(path).is_file():
            _temp_name(path).unlink()  # a write killed between open and rename
        restored.append(str(path))
    for rel in manifest.get("created_dirs", []):  # deepest first
        try:
            os.rmdir(_inside(root, rel))
        except OSError:
            pass  # not empty or already gone
    _discard(journal)
    return restored


def _discard(journal: Path) -> None:
    doomed = journal.with_name(_DONE + str(os.getpid()))
    os.rename(journal, doomed)  # atomic: the journal stops counting before it is deleted
    _fsync_dir(journal.parent)
    shutil.rmtree(doomed)


def _mark_committed(journal: Path) -> None:
    with open(journal / COMMITTED, "w") as fh:
        fh.write("every file of this run was written\n")
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(journal)


def _is_committed(journal: Path) -> bool:
    return (journal / COMMITTED).is_file()


def _pending_journal(root: Path) -> Path | None:
    """The root's journal when there is one; refuses anything there that a run does not leave."""
    journal = root / JOURNAL
    if journal.is_symlink() or (journal.exists() and not journal.is_dir()):
        raise FixRefused(f"{journal} is not a directory: the fix pack keeps its journal there and did "
                         "not write this; move it aside, then run again")
    return journal if journal.is_dir() else None


def _run_journals(manifest: dict, skip: list[Path]):
    """(tree, journal, manifest) of the same run's journals in its other trees, where they still are."""
    for other in map(Path, manifest.get("other_roots", [])):
        if other in skip or not other.is_dir():
            continue
        try:
            theirs = _pending_journal(other)
            their_manifest = _read_manifest(theirs) if theirs else {}
        except FixRefused:
            continue  # not this run's to judge: a run on that tree refuses it there
        if theirs and their_manifest.get("run") == manifest.get("run"):
            yield other, theirs, their_manifest


def recover(roots, legacy_roots=()) -> tuple[list[str], list[str]]:
    """Undo, or finish, an interrupted run found in these trees (and in the other trees of that run,
    where they still are and no other run holds them). `legacy_roots`: folders that may hold a
    journal of the earlier layout (at the folder holding the package, paths relative to it), undone
    the same way. Returns (files restored, trees whose committed run was finished)."""
    restored: list[str] = []
    finished: list[str] = []
    roots = _unique_roots(roots)
    for root in [*roots, *_unique_roots(legacy_roots)]:
        for leftover in [*root.glob(_STAGING + "*"), *root.glob(_DONE + "*")]:
            shutil.rmtree(leftover, ignore_errors=True)  # a journal never completed, or discarded
        journal = _pending_journal(root)
        if journal is None:
            continue
        manifest = _read_manifest(journal)
        others = list(_run_journals(manifest, roots))
        if _is_committed(journal) or any(_is_committed(j) for _t, j, _m in others):
            for other, theirs, _m in others:
                with ExitStack() as stack:
                    if _try_lock(other, stack, wait=False):
                        _discard(theirs)
                    else:  # its holder recovers it, and must see the run committed
                        try:
                            _mark_committed(theirs)
                        except FileNotFoundError:
                            pass  # its holder has just finished it
                    finished.append(str(other))
            _discard(journal)
            finished.append(str(root))
            continue
        restored += _restore(root, journal, manifest)
        for other, theirs, their_manifest in others:
            with ExitStack() as stack:
                if _try_lock(other, stack, wait=False):  # else a run holds it, and recovers it first
                    restored += _restore(other, theirs, their_manifest)
    return restored, finished


def check_writable(changes) -> None:
    """Refuse, before any write, what the writes would fail on: read-only files, folders that cannot
    be written, a folder where a file goes, a file where a folder goes."""
    for path in changes:
        if os.path.isdir(path) and not os.path.islink(path):
            raise FixRefused(f"{path} is a directory where a fix writes a file; refusing before any write")
        if path.exists() and not os.stat(path).st_mode & 0o222:
            raise FixRefused(f"{path} is read-only; refusing before any write")
        folder = _existing_ancestor(path.parent)
        if not folder.is_dir():
            raise FixRefused(f"{folder} is a file where a fix needs a directory; refusing before any write")
        if not os.access(folder, os.W_OK):
            raise FixRefused(f"{folder} is not writable; refusing before any write")


def _root_of(path: Path, roots: list[Path]) -> tuple[Path, str]:
    for root in sorted(roots, key=lambda r: len(r.parts), reverse=True):
        if root in path.parents:
            return root, path.relative_to(root).as_posix()
    raise FixRefused(f"{path} is outside the trees of this run ({', '.join(map(str, roots))})")


def _write_journal(root: Path, rels: list[str], run: str, other_roots: list[Path]) -> Path:
    """The complete journal of one tree, under its staging name (renamed into place by the caller)."""
    staging = root / (_STAGING + str(os.getpid()))
    staging.mkdir()
    entries, created_dirs = [], set()
    for index, rel in enumerate(rels):
        path = root / rel
        if path.exists():
            st = os.stat(path)
            shutil.copyfile(path, staging / str(index))
            with open(staging / str(index), "rb") as fh:
                os.fsync(fh.fileno())
            entries.append({"path": rel, "backup": str(index), "mode": st.st_mode & 0o7777,
                            "owner": [st.st_uid, st.st_gid]})
        else:
            entries.append({"path": rel, "backup": None})
            folder = path.parent
            while not folder.exists():
                created_dirs.add(folder.relative_to(root).as_posix())
                folder = folder.parent
    with open(staging / "manifest.json", "w") as fh:
        json.dump({"run": run, "other_roots": [str(r) for r in other_roots], "files": entries,
                   "created_dirs": sorted(created_dirs, key=len, reverse=True)}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(staging)
    return staging


def commit(roots, changes: dict[Path, tuple[bytes, int] | None]) -> None:
    """Write `changes` (absolute path -> (new bytes, mode), None to delete) all or nothing, into
    `roots` (the packages' directories, by any path)."""
    roots = _unique_roots(roots)
    check_writable(changes)
    # Each file by its real folder, so it falls in its package's real directory however reached.
    changes = {real_tree(path.parent) / path.name: new for path, new in changes.items()}
    per_root: dict[Path, list[str]] = {}
    for path in sorted(changes):
        root, rel = _root_of(path, roots)
        per_root.setdefault(root, []).append(rel)
    run = uuid.uuid4().hex
    journals = {root: _write_journal(root, rels, run, [r for r in per_root if r != root])
                for root, rels in per_root.items()}
    for root, staging in journals.items():
        os.rename(staging, root / JOURNAL)  # from here on, this journal can undo its tree
        _fsync_dir(root)
    journals = {root: root / JOURNAL for root in journals}

    kill_after = int(os.environ.get(FAULT_ENV, "0") or 0)
    steps = 0

    def step_done():  # a file written, a journal marked or discarded: where the crash tests kill
        nonlocal steps
        steps += 1
        if kill_after and steps >= kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    folders = set()
    try:
        for root, rels in per_root.items():
            for rel in rels:
                path, new = root / rel, changes[root / rel]
                if new is None:
                    path.unlink(missing_ok=True)
                    _remove_empty_parents(path.parent, root)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    owner = os.stat(path) if path.exists() else None
                    _write_bytes(path, *new, (owner.st_uid, owner.st_gid) if owner else None)
                folders.add(path.parent if path.parent.exists() else root)
                step_done()
        for folder in folders:  # the renames reach the disk before the journal goes
            _fsync_dir(folder)
    except BaseException as exc:
        for root, journal in journals.items():
            _restore(root, journal)
        if isinstance(exc, OSError):
            where = f" {exc.filename}" if exc.filename else ""
            raise FixRefused(f"writing{where} failed: {os.strerror(exc.errno) if exc.errno else exc}; "
                             "every file was restored, nothing changed") from None
        raise
    for journal in journals.values():  # the commit point: from the first marker on, recovery finishes
        _mark_committed(journal)
        step_done()
    for journal in journals.values():
        _discard(journal)
        step_done()

