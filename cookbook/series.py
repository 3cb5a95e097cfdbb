"""Checking, applying and reverting a profile's series of fixes.

Every run works the series out on a scratch copy of the files it touches (with `git apply`, zero
fuzz), and only when every fix has its answer does it write, all at once, through the journal.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import git

from . import journal, patchfile, sources
from .errors import EXIT_BASE_MISMATCH, EXIT_FIX_FAILED, EXIT_OK, BaseMismatch, CookbookError, FixRefused, UsageError
from .profiles import REPO_ROOT, Fix, Profile

STAMP = "cookbook-fixes.json"
MODES = ("apply", "check", "revert", "verify")


@dataclass
class PatchResult:
    target: str
    patch: str  # path of the patch file, relative to the repository when inside it
    sha256: str
    files: list[str]
    status: str = ""  # patched / already applied / reverted / not applied / failed
    exact: bool | None = None  # pre-image (or post-image) blobs identical to the patch's index lines
    reason: str = ""


@dataclass
class FixResult:
    name: str
    title: str
    targets: list[str]
    status: str = ""  # patched / already applied / reverted / not applied / failed / not yet available / out of scope
    reason: str = ""
    patches: list[PatchResult] = field(default_factory=list)

    @property
    def exact(self) -> bool | None:
        flags = [p.exact for p in self.patches if p.exact is not None]
        return all(flags) if flags else None


@dataclass
class TargetResult:
    name: str
    root: str
    pin: str
    ref: str
    commit: str | None = None
    how: str = ""
    matches: bool = False
    evidence: dict = field(default_factory=dict)


@dataclass
class RunReport:
    profile: str
    mode: str
    scope: list[str]
    targets: dict[str, TargetResult] = field(default_factory=dict)
    fixes: list[FixResult] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    stamps: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    exit_code: int = EXIT_OK
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


class Scratch:
    """Copies of the files a run touches, per target, where `git apply` works the series out."""

    def __init__(self, roots: dict[str, Path], files: dict[str, set[str]]):
        self.dir = Path(tempfile.mkdtemp(prefix="cookbook-scratch-"))
        self.roots = roots
        self.original: dict[tuple[str, str], bytes | None] = {}
        for target, rels in files.items():
            for rel in rels:
                src, dst = roots[target] / rel, self.dir / target / rel
                data = src.read_bytes() if src.is_file() else None
                self.original[(target, rel)] = data
                if data is not None:
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(data)

    def current(self, target: str, rel: str) -> bytes | None:
        path = self.dir / target / rel
        return path.read_bytes() if path.is_file() else None

    def git_apply(self, target: str, patches: list[Path], *flags: str) -> tuple[bool, str]:
        """One `git apply` of the patches in order: all or nothing, zero fuzz."""
        workdir = self.dir / target
        workdir.mkdir(exist_ok=True)
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(self.dir))
        status, _out, err = git.cmd.Git(str(workdir)).execute(
            ["git", "apply", *flags, *map(str, patches)], env=env,
            with_extended_output=True, with_exceptions=False)
        return status == 0, err

    def changes(self) -> dict[Path, bytes | None]:
        """Real path -> new bytes for every file whose content differs from before the run."""
        out = {}
        for (target, rel), before in self.original.items():
            after = self.current(target, rel)
            if after != before:
                out[self.roots[target] / rel] = after
        return out

    def close(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def _failed_hunk(parsed: patchfile.ParsedPatch, git_error: str) -> str:
    """Name the hunk git stopped at (git says `patch failed: FILE:LINE`)."""
    m = re.search(r"patch failed: (\S+):(\d+)", git_error)
    detail = git_error.strip().splitlines()
    summary = "; ".join(line.removeprefix("error: ") for line in detail if line.startswith("error:")) or git_error.strip()
    if not m:
        return summary
    import unidiff

    rel, line = m.group(1), int(m.group(2))
    for pfile in unidiff.PatchSet(parsed.text.decode()):
        if pfile.path == rel:
            for hunk in pfile:
                if hunk.source_start == line:
                    header = f"@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@{hunk.section_header and ' ' + hunk.section_header}"
                    return f"{summary}; hunk {header} does not match {rel}"
    return summary


def _blobs_match(scratch: Scratch, target: str, parsed: patchfile.ParsedPatch, side: str) -> tuple[bool, str]:
    """Are the files byte-identical to the patch's pre-image ("pre") or post-image ("post")?"""
    for change in parsed.changes:
        rel = change.old_path if side == "pre" else change.new_path
        want = change.pre_blob if side == "pre" else change.post_blob
        if rel is None:
            continue
        data = scratch.current(target, rel)
        found = patchfile.blob_id(data) if data is not None else None
        if want and found != want:
            return False, f"{rel} is blob {found}, the patch was written for {want}"
    return True, ""


def check_requirements(profile: Profile, fixes: list[Fix]) -> None:
    names = {f.name for f in fixes}
    for fix in fixes:
        missing = [r for r in fix.requires if r not in names]
        if missing:
            raise UsageError(f"fix {fix.name} requires {', '.join(missing)}; name it on the command line")
        clash = [c for c in fix.conflicts if c in names]
        if clash:
            raise UsageError(f"fix {fix.name} conflicts with {', '.join(clash)}; they cannot be applied together")


def _stamp_changes(profile: Profile, report: RunReport, roots: dict[str, Path],
                   revert: bool) -> dict[Path, bytes | None]:
    changes = {}
    for target in report.scope:
        package = profile.targets[target].package
        path = roots[target] / package / STAMP
        try:
            stamp = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            stamp = {}
        profiles = stamp.setdefault("profiles", {})
        if revert:
            profiles.pop(profile.name, None)
        else:
            t = report.targets[target]
            profiles[profile.name] = {
                "profile_file": _display(profile.path),
                "target": target, "pin": t.pin, "commit_found": t.commit, "how": t.how,
                # "applied" whether this run patched it or found it patched: re-runs write nothing.
                "fixes": [{"name": f.name, "status": "applied",
                           "patches": [{"file": p.patch, "sha256": p.sha256} for p in f.patches
                                       if p.target == target]}
                          for f in report.fixes if target in f.targets and f.status != "out of scope"],
            }
        new = (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode() if profiles else None
        old = path.read_bytes() if path.exists() else None
        if new != old:
            changes[path] = new
    return changes


def run(profile: Profile, roots: dict[str, Path], names: list[str], mode: str = "apply",
        strict: bool = False, check_pin: bool = True) -> RunReport:
    """Work the series `names` out against `roots` ({target: dir holding the package});
    in mode "apply"/"revert" write the result all or nothing. Never raises for a refusal: the
    report carries the exit code and the reason."""
    assert mode in MODES
    report = RunReport(profile=profile.name, mode=mode, scope=sorted(roots))
    fixes = [profile.load_fix(n) for n in names]
    check_requirements(profile, fixes)
    try:
        # Every run, even a dry one, first undoes a run that was interrupted on these trees.
        with journal.locked(roots.values()):
            report.recovered = journal.recover(roots.values())
            _run_locked(profile, roots, fixes, mode, strict, check_pin, report)
    except CookbookError as exc:
        report.exit_code, report.error = exc.exit_code, str(exc)
    return report


def _run_locked(profile, roots, fixes, mode, strict, check_pin, report: RunReport) -> None:
    scope = set(roots)
    for target in sorted(scope):
        pin = profile.targets[target]
        ident = sources.identify(roots[target], pin.package, pin.distribution)
        report.targets[target] = TargetResult(
            name=target, root=str(roots[target]), pin=pin.commit, ref=pin.ref, commit=ident.commit,
            how=ident.how, matches=pin.matches(ident.commit), evidence=ident.evidence)
        if not (roots[target] / pin.package).is_dir():
            raise BaseMismatch(f"{target}: no {pin.package}/ package directory under {roots[target]}")

    # Refusals that need no file access come first: nothing is read twice, nothing written.
    parsed: dict[tuple[str, str], patchfile.ParsedPatch] = {}
    missing = []
    for fix in fixes:
        result = FixResult(name=fix.name, title=fix.title, targets=fix.targets)
        report.fixes.append(result)
        in_scope = [t for t in fix.targets if t in scope]
        if not in_scope:
            result.status, result.reason = "out of scope", f"touches {', '.join(fix.targets)} only"
            continue
        have = {p.target for p in fix.patches}
        if any(t not in have for t in in_scope):
            result.status = "not yet available"
            result.reason = f"no patch for {', '.join(t for t in in_scope if t not in have)} yet"
            missing.append(fix.name)
            continue
        for ref in fix.patches_for(scope):
            patch = patchfile.parse(ref.path)
            patchfile.check_paths(patch, roots[ref.target], profile.targets[ref.target].package)
            parsed[(fix.name, ref.target)] = patch
            result.patches.append(PatchResult(target=ref.target, patch=_display(ref.path),
                                              sha256=patch.sha256, files=patch.touched))
    if missing:
        raise FixRefused(f"not yet available: {', '.join(missing)}; the profile cannot be applied "
                         "until every fix in scope has a patch")
    mismatched = [t for t in report.targets.values() if not t.matches]
    if check_pin and mismatched:
        raise BaseMismatch("; ".join(
            f"{t.name}: expected commit {t.pin} ({t.ref}), found {t.commit or 'none'} ({t.how})"
            for t in mismatched) + "; nothing was written")

    files: dict[str, set[str]] = {t: set() for t in scope}
    for (_name, target), patch in parsed.items():
        files[target].update(patch.touched)
    scratch = Scratch(roots, files)
    try:
        ordered = list(reversed(report.fixes)) if mode == "revert" else report.fixes
        pending = [r for r in ordered if not r.status]
        for target in sorted(scope):
            items = [(p, parsed[(r.name, target)]) for r in pending for p in r.patches if p.target == target]
            if not _whole_series(scratch, target, items, mode):
                for presult, patch in items:
                    _one_patch(scratch, patch, presult, mode, strict)
                    if presult.status == "failed":
                        break
        for result in pending:
            failed = [p for p in result.patches if p.status == "failed"]
            if failed:
                result.status, result.reason = "failed", "; ".join(p.reason for p in failed)
                raise FixRefused(f"{result.name}: {result.reason}; nothing was written")
            statuses = {p.status for p in result.patches}
            if "" in statuses:  # an earlier fix on the same target failed first
                continue
            result.status = statuses.pop() if len(statuses) == 1 else (
                "patched" if mode != "revert" else "reverted")
            result.reason = "; ".join(p.reason for p in result.patches if p.reason)
        if mode in ("apply", "revert"):
            changes = scratch.changes()
            changes.update(_stamp_changes(profile, report, roots, revert=(mode == "revert")))
            if changes:
                journal.commit(roots.values(), changes)
            report.written = sorted(str(p) for p in changes)
            report.stamps = [str(p) for p in changes if p.name == STAMP and changes[p] is not None]
    finally:
        scratch.close()


def _exact_chain(scratch: Scratch, target: str, items, state: str) -> bool:
    """Is the series exact: does each patch's pre-image blob equal the file as the earlier patches
    leave it, starting from the file as it is ("pre") or ending at it ("post")?"""
    files: dict[str, list] = {}
    for _presult, patch in items:
        for change in patch.changes:
            for rel in {change.old_path, change.new_path} - {None}:
                files.setdefault(rel, []).append(change)
    for rel, changes in files.items():
        data = scratch.original[(target, rel)]
        blob = patchfile.blob_id(data) if data is not None else None
        chain = [(c.pre_blob, c.post_blob) for c in changes]
        if any(chain[k][0] != chain[k - 1][1] for k in range(1, len(chain))):
            return False
        if blob != (chain[0][0] if state == "pre" else chain[-1][1]):
            return False
    return True


def _whole_series(scratch: Scratch, target: str, items, mode: str) -> bool:
    """Fast path: when the series is exact on the files as they are, one `git apply` of all its
    patches (or one reverse check) answers for every fix. Otherwise the caller goes patch by patch
    (which also finds which hunk failed)."""
    if not items:
        return True
    ordered = [patch.path for _p, patch in items]
    if mode == "revert":
        done, undone = "reverted", "not applied"
        if _exact_chain(scratch, target, items[::-1], "post") and scratch.git_apply(target, ordered, "-R")[0]:
            status = done
        elif _exact_chain(scratch, target, items[::-1], "pre") and scratch.git_apply(target, ordered[::-1], "--check")[0]:
            status = undone
        else:
            return False
    else:
        if _exact_chain(scratch, target, items, "pre") and scratch.git_apply(target, ordered)[0]:
            status = "patched"
        elif _exact_chain(scratch, target, items, "post") and scratch.git_apply(target, ordered[::-1], "-R", "--check")[0]:
            status = "already applied"
        else:
            return False
    for presult, _patch in items:
        presult.status, presult.exact = status, True
    return True


def _one_patch(scratch: Scratch, parsed: patchfile.ParsedPatch, result: PatchResult, mode: str,
               strict: bool) -> None:
    target, path = result.target, parsed.path
    forward, reverse = ("-R",) if mode == "revert" else (), () if mode == "revert" else ("-R",)
    ok, err = scratch.git_apply(target, [path], "--check", *forward)
    if ok:
        result.exact, why = _blobs_match(scratch, target, parsed, "post" if mode == "revert" else "pre")
        if not result.exact:
            if strict and mode != "revert":
                result.status, result.reason = "failed", f"applies only by context (--strict): {why}"
                return
            result.reason = f"applies by context: {why}"
        scratch.git_apply(target, [path], *forward)
        result.status = "reverted" if mode == "revert" else "patched"
        return
    ok_reverse, _ = scratch.git_apply(target, [path], "--check", *reverse)
    if ok_reverse:
        result.exact, _why = _blobs_match(scratch, target, parsed, "pre" if mode == "revert" else "post")
        result.status = "not applied" if mode == "revert" else "already applied"
        return
    result.status, result.reason = "failed", _failed_hunk(parsed, err)
