"""The functions the CLI, install.sh, the builder and the tests call."""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from . import patchfile, series, sources
from .errors import BaseMismatch, FixRefused, UsageError
from .profiles import Profile, load_profile
from .series import RunReport

__all__ = ["load_profile", "resolve_roots", "run", "apply_unpinned", "patched_copy", "identify",
           "check_probe", "refresh", "verify_passes"]


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


def run(profile_name: str, overrides: dict[str, Path | None], opt_ins: list[str], mode: str = "apply",
        only_targets: list[str] | None = None, strict: bool = False) -> tuple[Profile, RunReport]:
    profile = load_profile(profile_name)
    roots = resolve_roots(profile, overrides, only_targets)
    if mode != "verify":
        return profile, series.run(profile, roots, profile.series(opt_ins), mode=mode, strict=strict)
    passes = verify_passes(profile)
    report = series.run(profile, roots, passes[0], mode="verify", strict=strict, check_pin=False)
    for names in passes[1:]:  # an opt-in that conflicts with another is verified on its own
        alone = series.run(profile, roots, names, mode="verify", strict=strict, check_pin=False)
        report.fixes.append(alone.fixes[-1])
        if not alone.ok and report.ok:
            report.exit_code, report.error = alone.exit_code, alone.error
    return profile, report


def verify_passes(profile: Profile) -> list[list[str]]:
    """Series that together try every fix of the profile: the defaults with every opt-in that
    goes with them, then each opt-in that conflicts with one already taken, on its own."""
    fixes = {n: profile.load_fix(n) for n in profile.all_fixes}

    def clash(a: str, b: str) -> bool:
        return b in fixes[a].conflicts or a in fixes[b].conflicts

    first, alone = list(profile.fixes), []
    for name in profile.opt_in:
        (alone if any(clash(name, other) for other in first) else first).append(name)
    return [first] + [profile.fixes + [r for r in fixes[n].requires if r not in profile.fixes] + [n]
                      for n in alone]


def apply_unpinned(profile_name: str, roots: dict[str, Path], fixes: list[str]) -> RunReport:
    """Apply the named fixes (in profile order) to trees whatever their commit: for tests and
    benchmarks that patch a copy of an upstream tree. Raises on any refusal."""
    profile = load_profile(profile_name)
    unknown = [f for f in fixes if f not in profile.all_fixes]
    if unknown:
        raise UsageError(f"unknown fix {unknown} for profile {profile.name}")
    names = [f for f in profile.all_fixes if f in fixes]
    report = series.run(profile, {t: Path(r) for t, r in roots.items()}, names, mode="apply",
                        check_pin=False)
    if not report.ok:
        raise FixRefused(report.error)
    return report


def patched_copy(src_root: Path, target: str, fixes: list[str], dest: Path,
                 profile: str = "v0.30.0") -> Path:
    """dest/<package>: a copy of src_root/<package> with the named fixes of the profile applied in
    profile order, pin not checked (as `verify` does). For tests and benchmarks that compare a
    pristine upstream tree with a patched one; returns dest, ready for PYTHONPATH."""
    package = load_profile(profile).targets[target].package
    shutil.copytree(Path(src_root) / package, Path(dest) / package, symlinks=True)
    apply_unpinned(profile, {target: Path(dest)}, fixes)
    return Path(dest)


def identify(profile_name: str, overrides: dict[str, Path | None],
             only_targets: list[str] | None = None) -> list[series.TargetResult]:
    profile = load_profile(profile_name)
    out = []
    for target, root in resolve_roots(profile, overrides, only_targets).items():
        pin = profile.targets[target]
        ident = sources.identify(root, pin.package, pin.distribution)
        out.append(series.TargetResult(name=target, root=str(root), pin=pin.commit, ref=pin.ref,
                                       commit=ident.commit, how=ident.how,
                                       matches=pin.matches(ident.commit), evidence=ident.evidence))
    return out


def check_probe(profile_name: str, probe_result: dict) -> list[str]:
    """Judge a base image's probe (cookbook.probe output) against a profile: the problems found,
    each naming what was expected and what was found. Empty: the base is the profile's."""
    profile = load_profile(profile_name)
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


def refresh(profile_name: str, roots: dict[str, Path]) -> list[str]:
    """Rewrite each patch of the profile (all fixes, in order) so that it is exact on its base
    plus the earlier fixes: quilt's `refresh` for the whole series. Returns the rewritten files."""
    profile = load_profile(profile_name)
    rewritten = []
    for target, root in roots.items():
        package = profile.targets[target].package
        work = Path(tempfile.mkdtemp(prefix="cookbook-refresh-"))
        try:
            shutil.copytree(root / package, work / package, symlinks=True)
            git = ["git", "-C", str(work), "-c", "user.name=refresh", "-c", "user.email=refresh@localhost"]
            subprocess.run(git[:3] + ["init", "-q"], check=True)
            subprocess.run(git + ["add", "-A"], check=True)
            subprocess.run(git + ["commit", "-qm", "base"], check=True)
            for name in profile.all_fixes:
                for ref in profile.load_fix(name).patches_for([target]):
                    patchfile.parse(ref.path)
                    done = subprocess.run(git[:3] + ["apply", str(ref.path)], capture_output=True, text=True)
                    if done.returncode:
                        raise FixRefused(f"refresh: {name} does not apply after the earlier fixes: {done.stderr.strip()}")
                    subprocess.run(git + ["add", "-A"], check=True)
                    diff = subprocess.run(git + ["diff", "--cached", "--full-index"], capture_output=True,
                                          check=True).stdout
                    if diff != ref.path.read_bytes():
                        ref.path.write_bytes(diff)
                        rewritten.append(str(ref.path))
                    subprocess.run(git + ["commit", "-qm", name], check=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return rewritten
