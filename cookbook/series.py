"""Checking, applying and reverting a profile's series of fixes.

Every run works the series out on a scratch copy of the files it touches (with `git apply`, zero
fuzz), and only when every fix has its answer does it write, all at once, through the journal.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from . import journal, patchfile, sources, stamp
from .errors import BaseMismatch, FixRefused
from .gitcmd import blob_id, git
from .profiles import REPO_ROOT, Fix, Profile
from .results import FixResult, Mode, PatchResult, RunReport, Status, TargetResult


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


class Scratch:
    """Copies of the files a run touches, per target, where `git apply` works the series out.

    It lives in the temporary folder under a lock held for its lifetime, so the folder of a run
    that was killed is recognised (its lock is free) and removed by the next run."""

    def __init__(self, roots: dict[str, Path], files: dict[str, set[str]]):
        _remove_stale_scratch()
        self.dir = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX))
        self._lock = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        self.roots = roots
        self.original: dict[tuple[str, str], tuple[bytes, int] | None] = {}
        for target, rels in files.items():
            for rel in rels:
                src, dst = roots[target] / rel, self.dir / target / rel
                if src.is_file():
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)  # modes matter: a patch may change them
                self.original[(target, rel)] = self.current(target, rel)

    def current(self, target: str, rel: str) -> tuple[bytes, int] | None:
        """(bytes, permission bits) of the scratch file, None when it does not exist."""
        path = self.dir / target / rel
        if path.is_symlink():  # patches with links are refused when parsed; never follow one
            raise FixRefused(f"{target}: {rel} became a symbolic link; refusing before any write")
        return (path.read_bytes(), path.stat().st_mode & 0o7777) if path.is_file() else None

    def blob(self, target: str, rel: str) -> str | None:
        state = self.current(target, rel)
        return blob_id(state[0]) if state else None

    def git_apply(self, target: str, patches: list[Path], *flags: str) -> tuple[bool, str]:
        """One `git apply` of the patches in order: all or nothing, zero fuzz."""
        workdir = self.dir / target
        workdir.mkdir(exist_ok=True)
        done = git("apply", "--whitespace=nowarn", *flags, *map(str, patches), cwd=workdir,
                   env={"GIT_CEILING_DIRECTORIES": str(self.dir)})
        return done.returncode == 0, done.stderr

    def changes(self, mode_changes: set[tuple[str, str]]) -> dict[Path, tuple[bytes, int] | None]:
        """Real path -> new (bytes, mode), or None to delete, for every file the run changes.
        `git apply` writes every file 0644/0755 from the patch's mode: a file keeps its own
        permission bits unless a patch changes its mode (`mode_changes`: (target, path))."""
        out = {}
        for (target, rel), before in self.original.items():
            after = self.current(target, rel)
            if after is not None and before is not None:
                mode = _with_exec_bit(before[1], after[1]) if (target, rel) in mode_changes else before[1]
                after = (after[0], mode)
            if after != before:
                out[self.roots[target] / rel] = after
        return out

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._lock)


SCRATCH_PREFIX = "cookbook-scratch-"


def _remove_stale_scratch() -> None:
    """Remove the scratch folders of killed runs: those whose lock nobody holds (and not just made:
    a run creates its folder an instant before it locks it)."""
    for folder in Path(tempfile.gettempdir()).glob(SCRATCH_PREFIX + "*"):
        try:
            if time.time() - folder.stat().st_mtime < 60:
                continue
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
        except BlockingIOError:
            pass  # a live run's
        finally:
            os.close(fd)


def _with_exec_bit(before: int, after: int) -> int:
    """The file's own permission bits with the executable bit git wrote (x where r is)."""
    return before | (before & 0o444) >> 2 if after & 0o100 else before & ~0o111


def _failed_hunk(parsed: patchfile.ParsedPatch, git_error: str) -> str:
    """Name the hunk git stopped at (git says `patch failed: FILE:LINE`)."""
    m = re.search(r"patch failed: (.+):(\d+)$", git_error, re.MULTILINE)
    detail = git_error.strip().splitlines()
    summary = "; ".join(line.removeprefix("error: ") for line in detail if line.startswith("error:")) or git_error.strip()
    if not m:
        return summary
    rel, line = patchfile.unquote_path(m.group(1)), int(m.group(2))
    for change in parsed.changes:
        if rel in change.paths:
            for hunk in change.hunks:
                if hunk.source_start == line:
                    return f"{summary}; hunk {hunk} does not match {rel}"
    return summary


def _pre_image_matches(scratch: Scratch, target: str, parsed: patchfile.ParsedPatch) -> tuple[bool, str]:
    """Are the files byte-identical to what the patch was written for (its `index` pre-image)?"""
    for change in parsed.changes:
        if change.old_path is None:
            continue
        found = scratch.blob(target, change.old_path)
        if change.pre_blob and found != change.pre_blob:
            return False, f"{change.old_path} is blob {found}, the patch was written for {change.pre_blob}"
    return True, ""


def recorded_opt_ins(profile: Profile, roots: dict[str, Path]) -> list[str]:
    """Opt-ins the trees' stamps record as applied under this profile: a run keeps (or, with
    --revert, removes) them, so the stamp always describes the tree."""
    found = set()
    for target, root in roots.items():
        found.update(stamp.fixes_recorded(stamp.read(stamp.path(root, profile.targets[target].package)),
                                          profile.name))
    return [n for n in profile.opt_in if n in found]


def _stamp_changes(profile: Profile, report: RunReport, roots: dict[str, Path],
                   revert: bool) -> dict[Path, tuple[bytes, int] | None]:
    changes = {}
    for target in report.scope:
        path = stamp.path(roots[target], profile.targets[target].package)
        old = path.read_bytes() if path.exists() else None
        # "applied" whether this run patched it or found it patched: re-runs write nothing.
        fixes = [{"name": f.name, "status": "applied",
                  "patches": [{"file": p.patch, "sha256": p.sha256} for p in f.patches if p.target == target]}
                 for f in report.fixes if target in f.targets and f.status != Status.OUT_OF_SCOPE]
        entry = None
        if fixes and not revert:  # a package none of the series touches gets no stamp
            t = report.targets[target]
            entry = {"profile_file": _display(profile.path), "target": target, "pin": t.pin,
                     "commit_found": t.commit, "how": t.how, "fixes": fixes}
        new = stamp.updated(stamp.read(path), profile.name, entry)
        if new != old:
            changes[path] = (new, 0o644) if new is not None else None
    return changes


def _package_dirs(profile: Profile, roots: dict[str, Path]) -> list[Path]:
    """The packages' directories that exist: what a run locks and journals (by their real path)."""
    dirs = [Path(root) / profile.targets[target].package for target, root in roots.items()]
    return [d for d in dirs if d.is_dir()]


def run(profile: Profile, roots: dict[str, Path], opt_ins: list[str], mode: Mode = Mode.APPLY,
        strict: bool = False, check_pin: bool = True) -> RunReport:
    """Work the profile's series (its plan for `opt_ins` and what the stamps record) out against
    `roots` ({target: dir holding the package}); in apply/revert write the result all or nothing.
    Never raises for a refusal or a base mismatch: the report carries the exit code and the
    reason. Usage and profile errors raise."""
    mode = Mode(mode)
    report = RunReport(profile=profile.name, mode=mode, scope=sorted(roots))
    packages = _package_dirs(profile, roots)
    # Every run, even a dry one, first undoes (or finishes) a run that was interrupted on these trees.
    with journal.locked(packages):
        try:
            report.recovered, report.finished = journal.recover(packages, legacy_roots=roots.values())
            stamped = recorded_opt_ins(profile, roots) if mode != Mode.VERIFY else []
            passes = profile.plan(opt_ins, stamped, mode)
        except (FixRefused, BaseMismatch) as exc:
            report.refuse(exc.exit_code, str(exc))
            return report
        # verify may need more than one series: an opt-in that conflicts with another, on its own
        for index, series in enumerate(passes):
            this = RunReport(profile=profile.name, mode=mode, scope=report.scope) if index else report
            try:
                _run_locked(profile, roots, packages, series, mode, strict, check_pin, this)
            except (FixRefused, BaseMismatch) as exc:
                this.refuse(exc.exit_code, str(exc))
            if index:
                report.add_pass(this)
    return report


def content_skip(profile: Profile, target: str) -> set[str]:
    """The files a content pin does not compare: the ones its build may rewrite and the ones the profile's
    fixes patch (the patches check those themselves)."""
    pin = profile.targets[target]
    patched = {rel for fix in profile.catalog.values() for ref in fix.patches_for([target])
               for rel in patchfile.paths_named(ref.path.read_bytes())}
    return set(pin.content.may_differ) | patched


def content_verdict(pin, differing: list[str]) -> tuple[str | None, str]:
    """(commit, how) of a build that records no commit, from the files that differ from the pin's manifest."""
    manifest = _display(pin.content.manifest)
    if differing:
        return None, (f"no commit recorded, and {len(differing)} file(s) differ from {manifest}: "
                      + ", ".join(differing[:5]) + (" …" if len(differing) > 5 else ""))
    return pin.commit, (f"no commit recorded; every file of {manifest} identical but the ones the fixes "
                        f"patch and {', '.join(sorted(pin.content.may_differ))}")


def identify_target(profile: Profile, target: str, root: Path) -> TargetResult:
    """The commit of the code under root: its own records (sources.identify), or, when it records
    none and the pin has a content manifest, the pin itself if every file the profile's fixes do
    not touch is the pinned blob (a build may rewrite only the files the pin names, for a reason)."""
    pin = profile.targets[target]
    ident = sources.identify(root, pin.package, pin.distribution)
    commit, how = ident.commit, ident.how
    if commit is None and pin.content is not None and not ident.how.startswith("cannot identify"):
        differing = sources.differing_files(root, pin.content.blobs(), content_skip(profile, target))
        ident.evidence["content"] = {"manifest": _display(pin.content.manifest), "differing": differing[:50]}
        commit, how = content_verdict(pin, differing)
    return TargetResult(name=target, root=str(root), pin=pin.commit, ref=pin.ref, commit=commit, how=how,
                        matches=pin.matches(commit), evidence=ident.evidence)


def _identify(profile: Profile, roots: dict[str, Path], report: RunReport, check_pin: bool) -> None:
    """Each target's commit into the report; a mismatch refuses before any patch is read."""
    for target in sorted(roots):
        pin = profile.targets[target]
        if not (roots[target] / pin.package).is_dir():
            raise BaseMismatch(f"{target}: no {pin.package}/ package directory under {roots[target]}")
        report.targets[target] = identify_target(profile, target, roots[target])
    mismatched = [t for t in report.targets.values() if not t.matches]
    if check_pin and mismatched:
        raise BaseMismatch("; ".join(
            f"{t.name}: expected commit {t.pin} ({t.ref}), found {t.commit or 'none'} ({t.how})"
            for t in mismatched) + "; nothing was written")


def _run_locked(profile: Profile, roots: dict[str, Path], packages: list[Path], fixes: list[Fix], mode: Mode,
                strict: bool, check_pin: bool, report: RunReport) -> None:
    """One pass of the series under the packages' locks (`packages`: their directories, as run() locked them)."""
    scope = set(roots)
    _identify(profile, roots, report, check_pin)

    # Refusals that need no file access come first.
    parsed: dict[str, list[tuple[PatchResult, patchfile.ParsedPatch]]] = {t: [] for t in scope}
    missing = []
    for fix in fixes:
        result = FixResult(name=fix.name, title=fix.title, targets=fix.targets)
        report.fixes.append(result)
        in_scope = [t for t in fix.targets if t in scope]
        if not in_scope:
            result.status, result.reason = Status.OUT_OF_SCOPE, f"touches {', '.join(fix.targets)} only"
            continue
        have = {p.target for p in fix.patches}
        if any(t not in have for t in in_scope):
            result.status = Status.NOT_YET_AVAILABLE
            result.reason = f"no patch for {', '.join(t for t in in_scope if t not in have)} yet"
            missing.append(fix.name)
            continue
        for ref in fix.patches_for(scope):
            patch = patchfile.parse(ref.path)
            patchfile.check_paths(patch, roots[ref.target], profile.targets[ref.target].package)
            presult = PatchResult(target=ref.target, patch=_display(ref.path), sha256=patch.sha256,
                                  files=patch.touched)
            result.patches.append(presult)
            parsed[ref.target].append((presult, patch))
    if missing:
        raise FixRefused(f"not yet available: {', '.join(missing)}; the profile cannot be applied "
                         "until every fix in scope has a patch")

    scratch = Scratch(roots, {t: {f for _p, patch in items for f in patch.touched} for t, items in parsed.items()})
    try:
        for target in sorted(scope):
            _settle(scratch, target, parsed[target], mode, strict)
        pending = [r for r in report.fixes if not r.status]
        for result in pending:
            statuses = [p.status for p in result.patches]
            if Status.FAILED in statuses:
                result.status = Status.FAILED
            elif Status.PENDING not in statuses:
                result.status = statuses[0] if len(set(statuses)) == 1 else (
                    Status.REVERTED if mode == Mode.REVERT else Status.PATCHED)
            result.reason = "; ".join(p.reason for p in result.patches if p.reason)
        failed = [r for r in pending if r.status == Status.FAILED]
        if failed:
            raise FixRefused("; ".join(f"{r.name}: {r.reason}" for r in failed) + "; nothing was written")
        changes = scratch.changes({(t, c.old_path) for t, items in parsed.items() for _p, patch in items
                                   for c in patch.changes if c.changes_mode})
        if mode.writes:
            changes.update(_stamp_changes(profile, report, roots, revert=(mode == Mode.REVERT)))
        journal.check_writable(changes)
        if mode.writes and changes:
            journal.commit(packages, changes)
            report.written = sorted(str(p) for p in changes)
            report.stamps = [str(p) for p in changes if p.name == stamp.NAME and changes[p] is not None]
    except FixRefused:
        for result in report.fixes:  # nothing was written: say what each fix would have done
            result.status = result.status.unwritten()
        raise
    finally:
        scratch.close()


def _chain_state(items, scratch: Scratch, target: str) -> str | None:
    """"base" when every file is what the first patch touching it was written for and each patch's
    pre-image is the previous one's post-image (an exact series, nothing applied); "applied" when
    every file is the last patch's post-image of such a series; None otherwise."""
    chains: dict[str, list[tuple[str | None, str | None]]] = {}
    for _presult, patch in items:
        for c in patch.changes:
            if c.old_path:
                chains.setdefault(c.old_path, []).append((c.pre_blob, c.post_blob if c.new_path == c.old_path else None))
            if c.new_path and c.new_path != c.old_path:
                chains.setdefault(c.new_path, []).append((None, c.post_blob))
    at_base = at_end = True
    for rel, chain in chains.items():
        if any(chain[k][0] != chain[k - 1][1] for k in range(1, len(chain))):
            return None
        blob = scratch.blob(target, rel)
        at_base &= blob == chain[0][0]
        at_end &= blob == chain[-1][1]
    return "base" if at_base else "applied" if at_end else None


def _settled(presult: PatchResult, mode: Mode, was_applied: bool, exact: bool) -> None:
    presult.exact = exact
    if mode == Mode.REVERT:
        presult.status = Status.REVERTED if was_applied else Status.NOT_APPLIED
    else:
        presult.status = Status.ALREADY_APPLIED if was_applied else Status.PATCHED


def _settle(scratch: Scratch, target: str, items, mode: Mode, strict: bool) -> None:
    """Give each patch of one target its status, leaving the scratch files as the run wants them:
    the whole series applied (apply, check, verify) or none of it (revert).

    Which fixes the tree already has is found the way a patch stack is popped: each patch's
    reverse is tried from the last to the first; what remains must be the base, onto which the
    whole series is then replayed in order. A fix whose reverse applied was already there. The
    replay is also where each patch meets the file it was written for (exact) or not (by context),
    and where a conflict is found and named. An exact series in a known state takes one
    `git apply` instead (the common case)."""
    if not items:
        return
    paths = [patch.path for _p, patch in items]
    state = _chain_state(items, scratch, target)
    if state == "base" and scratch.git_apply(target, paths)[0]:
        for presult, _patch in items:
            _settled(presult, mode, False, True)
    elif state == "applied" and scratch.git_apply(target, paths[::-1], "-R")[0] and scratch.git_apply(target, paths)[0]:
        for presult, _patch in items:
            _settled(presult, mode, True, True)
    else:
        was_applied = [False] * len(items)
        for i in reversed(range(len(items))):
            files = items[i][1].touched
            before = [scratch.current(target, f) for f in files]
            # A reverse that changes nothing (a mode-only patch on a file without that mode) does
            # not mean the fix is there.
            was_applied[i] = (scratch.git_apply(target, [paths[i]], "-R")[0]
                              and [scratch.current(target, f) for f in files] != before)
        for (presult, patch), applied in zip(items, was_applied):
            matches, why = _pre_image_matches(scratch, target, patch)
            ok, err = scratch.git_apply(target, [patch.path])
            if not ok:
                presult.status, presult.reason = Status.FAILED, _failed_hunk(patch, err)
                return
            _settled(presult, mode, applied, matches)
            if not matches:
                presult.reason = f"applies by context: {why}"
                if strict:
                    presult.status, presult.reason = Status.FAILED, f"applies only by context (--strict): {why}"
                    return
    if mode == Mode.REVERT:
        ok, err = scratch.git_apply(target, paths[::-1], "-R")
        if not ok:  # cannot happen: the series was just replayed onto the base
            raise FixRefused(f"{target}: the series does not reverse after replaying it: {err.strip()}")
