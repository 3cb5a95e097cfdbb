"""The functions the CLI, install.sh, the builder and the tests call. Each takes a loaded
`Profile` (`load_profile` once, then pass it around)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from . import patchfile, series, sources
from .errors import BaseMismatch, FixRefused, UsageError
from .gitcmd import blob_id, git
from .profiles import DEFAULT_PROFILE, Profile, load_profile
from .results import Mode, RunReport, TargetResult

__all__ = ["DEFAULT_PROFILE", "load_profile", "resolve_roots", "run", "apply_unpinned", "patched_copy",
           "identify", "identify_by_content", "check_probe", "refresh", "manifest"]


def resolve_roots(profile: Profile, overrides: dict[str, Path | None], only: list[str] | None = None) -> dict[str, Path]:
    """{target: directory holding its package}: the given override, else the installed package."""
    unknown = [t for t in (only or []) if t not in profile.targets]
    if unknown:
        raise UsageError(f"unknown target {', '.join(unknown)}; profile {profile.name} has "
                         f"{', '.join(profile.targets)}")
    roots = {}
    for target in only or list(profile.targets):
        pin = profile.targets[target]
        root = overrides.get(target)
        if root is None:
            root = sources.locate(pin.package)
            if root is None:
                raise BaseMismatch(f"{target}: package {pin.package} is not installed for this Python "
                                   f"and no --{target}-root was given (expected {pin.commit}, {pin.ref})")
        root = Path(root).resolve()
        if not (root / pin.package).is_dir():
            raise BaseMismatch(f"{target}: {root} holds no {pin.package}/ package directory "
                               f"(expected {pin.package} at {pin.commit}, {pin.ref})")
        roots[target] = root
    return roots


def run(profile: Profile, overrides: dict[str, Path | None], opt_ins: list[str], mode: Mode = Mode.APPLY,
        only_targets: list[str] | None = None, strict: bool = False) -> RunReport:
    """A run of the profile on the trees found (or given): apply, check, revert or verify."""
    roots = resolve_roots(profile, overrides, only_targets)
    return series.run(profile, roots, opt_ins, mode=mode, strict=strict, check_pin=(Mode(mode) != Mode.VERIFY))


def apply_unpinned(profile: Profile | str, roots: dict[str, Path], fixes: list[str]) -> RunReport:
    """Apply the named fixes (in profile order) to trees whatever their commit: for tests and
    benchmarks that patch a copy of an upstream tree (a profile name or file will do). Raises on
    any refusal."""
    if isinstance(profile, str):
        profile = load_profile(profile)
    unknown = [f for f in fixes if f not in profile.catalog]
    if unknown:
        raise UsageError(f"unknown fix {unknown} for profile {profile.name}")
    report = series.run(profile.only(fixes), {t: Path(r) for t, r in roots.items()}, [], check_pin=False)
    if not report.ok:
        raise FixRefused(report.error)
    return report


def patched_copy(src_root: Path, target: str, fixes: list[str], dest: Path,
                 profile: Profile | None = None) -> Path:
    """dest/<package>: a copy of src_root/<package> with the named fixes of the profile (default:
    DEFAULT_PROFILE) applied in profile order, pin not checked (as `verify` does). For tests and
    benchmarks that compare a pristine upstream tree with a patched one; returns dest, ready for
    PYTHONPATH."""
    profile = profile or load_profile(DEFAULT_PROFILE)
    package = profile.targets[target].package
    shutil.copytree(Path(src_root) / package, Path(dest) / package, symlinks=True)
    apply_unpinned(profile, {target: Path(dest)}, fixes)
    return Path(dest)


def identify(profile: Profile, overrides: dict[str, Path | None],
             only_targets: list[str] | None = None) -> list[TargetResult]:
    return [series.identify_target(profile, target, root)
            for target, root in resolve_roots(profile, overrides, only_targets).items()]


def identify_by_content(profile: Profile, probe_result: dict) -> dict:
    """The probe's answer with each build that records no commit identified by its pin's content manifest
    (cookbook.probe's `content_differing`: the pin's commit when no file differs), as apply_all.py does."""
    for target, found in probe_result.items():
        pin = profile.targets.get(target)
        if pin is not None and pin.content is not None and found.get("commit") is None and "content_differing" in found:
            found["commit"], found["how"] = series.content_verdict(pin, found["content_differing"])
    return probe_result


def check_probe(profile: Profile, probe_result: dict) -> list[str]:
    """Judge a base image's probe (cookbook.probe output) against a profile: the problems found,
    each naming what was expected and what was found. Empty: the base is the profile's."""
    problems = []
    for target, pin in profile.targets.items():
        found = probe_result.get(target)
        if not found or not found.get("root"):
            problems.append(f"{target}: package {pin.package} is not installed (expected {pin.commit}, {pin.ref})")
            continue
        if not pin.matches(found.get("commit")):
            problems.append(f"{target}: expected commit {pin.commit} ({pin.ref}), installed code is "
                            f"{found.get('commit') or 'unidentified'} ({found.get('how')})")
        checkout = found.get("checkout_commit")
        if checkout and not pin.matches(checkout):
            problems.append(f"{target}: expected commit {pin.commit}, checkout {found.get('checkout')} is at {checkout}")
        if found.get("installed_matches_checkout") is False:
            files = found.get("differing_files") or []
            problems.append(f"{target}: installed {pin.package} differs from the checkout "
                            f"{found.get('checkout')} in {len(files)} file(s): {', '.join(files[:5])}"
                            f"{' …' if len(files) > 5 else ''}")
    return problems


def refresh(profile: Profile, roots: dict[str, Path]) -> list[str]:
    """Rewrite each patch of the profile (all fixes, in order) so that it is exact on its base
    plus the earlier fixes: quilt's `refresh` for the whole series. Returns the rewritten files."""
    rewritten = []
    for target, root in roots.items():
        package = profile.targets[target].package
        work = Path(tempfile.mkdtemp(prefix="cookbook-refresh-"))
        try:
            shutil.copytree(root / package, work / package, symlinks=True)

            def run_git(*args: str, text: bool = True):
                done = git("-c", "user.name=refresh", "-c", "user.email=refresh@localhost", *args,
                           cwd=work, text=text)
                if done.returncode:
                    raise FixRefused(f"refresh: `git {' '.join(args)}` failed: {done.stderr!s}")
                return done.stdout

            run_git("init", "-q")
            run_git("add", "-A")
            run_git("commit", "-qm", "base")
            for name in profile.all_fixes:
                for ref in profile.fix(name).patches_for([target]):
                    patchfile.parse(ref.path)
                    done = git("apply", str(ref.path), cwd=work)
                    if done.returncode:
                        raise FixRefused(f"refresh: {name} does not apply after the earlier fixes: {done.stderr.strip()}")
                    run_git("add", "-A")
                    diff = run_git("diff", "--cached", "--full-index", text=False)
                    if diff != ref.path.read_bytes():
                        ref.path.write_bytes(diff)
                        rewritten.append(str(ref.path))
                    run_git("commit", "-qm", name)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rewritten


def manifest(root: Path, package: str, commit: str) -> str:
    """The content manifest of a pristine tree: "<blob id> <path>" for every file of the package
    (profile key `content.manifest`), headed by the commit it records."""
    lines = [f"# {package} at {commit}: git blob id and path of every file (apply_all.py manifest)"]
    for path in sorted((Path(root) / package).rglob("*")):
        if path.is_file() and not path.is_symlink() and "__pycache__" not in path.parts:
            lines.append(f"{blob_id(path.read_bytes())} {path.relative_to(root).as_posix()}")
    return "\n".join(lines) + "\n"
