"""Profiles (the pins and the ordered series) and fix metadata, loaded and validated."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import ProfileError, UsageError

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILES_DIR = REPO_ROOT / "profiles"
FIXES_DIR = REPO_ROOT / "fixes"
TARGET_KEYS = {"package", "distribution", "commit", "ref", "repository", "image-checkout"}
UPSTREAM_STATUSES = {"not-yet", "submitted", "backport", "merged", "inappropriate"}


@dataclass(frozen=True)
class TargetPin:
    name: str  # "vllm" / "vllm-gaudi"
    package: str  # "vllm" / "vllm_gaudi"
    distribution: str
    commit: str
    ref: str
    repository: str = ""
    image_checkout: str = ""

    def matches(self, found: str | None) -> bool:
        """A found commit matches the pin when one is a prefix of the other (short ids)."""
        if not found:
            return False
        pin, found = self.commit.lower(), found.lower()
        return len(min(pin, found, key=len)) >= 7 and (pin.startswith(found) or found.startswith(pin))

    def as_probe_spec(self) -> dict:
        return {"package": self.package, "distribution": self.distribution,
                "image-checkout": self.image_checkout}


@dataclass(frozen=True)
class PatchRef:
    target: str
    path: Path  # absolute path of the .patch file
    base: str
    base_ref: str


@dataclass
class Fix:
    name: str
    folder: Path
    title: str
    targets: list[str]
    patches: list[PatchRef]
    requires: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def available(self) -> bool:
        return bool(self.patches)

    def patches_for(self, targets) -> list[PatchRef]:
        return [p for p in self.patches if p.target in targets]


@dataclass
class Profile:
    name: str
    path: Path
    targets: dict[str, TargetPin]
    fixes: list[str]  # defaults, in order
    opt_in: list[str]  # in pack order
    fixes_dir: Path
    description: str = ""

    @property
    def all_fixes(self) -> list[str]:
        return self.fixes + self.opt_in

    def series(self, opt_ins: list[str]) -> list[str]:
        """Defaults in order, then the named opt-ins in pack order."""
        known = set(self.all_fixes)
        unknown = [n for n in opt_ins if n not in known]
        if unknown:
            raise UsageError(
                f"unknown fix {', '.join(map(repr, unknown))} for profile {self.name}; "
                f"valid: {', '.join(self.all_fixes)}")
        wanted = set(opt_ins)
        return self.fixes + [n for n in self.opt_in if n in wanted]

    def load_fix(self, name: str) -> Fix:
        return load_fix(self.fixes_dir / name, self.targets)


def _read_yaml(path: Path, what: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ProfileError(f"{what} {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{what} {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{what} {path} must be a mapping, found {type(data).__name__}")
    return data


def profile_path(name_or_path: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        return candidate.resolve()
    path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ProfileError(f"no profile {name_or_path!r}; known: {', '.join(known)}")
    return path


def _load_targets(data: dict, path: Path, inherited: dict[str, TargetPin]) -> dict[str, TargetPin]:
    targets = dict(inherited)
    for tname, spec in (data.get("targets") or {}).items():
        if not isinstance(spec, dict):
            raise ProfileError(f"{path}: targets.{tname} must be a mapping")
        unknown = set(spec) - TARGET_KEYS
        if unknown:
            raise ProfileError(f"{path}: targets.{tname}: unknown keys {sorted(unknown)}")
        base = targets.get(tname)
        merged = {"package": base.package, "distribution": base.distribution, "commit": base.commit,
                  "ref": base.ref, "repository": base.repository,
                  "image-checkout": base.image_checkout} if base else {}
        merged.update({k: str(v) for k, v in spec.items()})
        missing = [k for k in ("package", "commit", "ref") if not merged.get(k)]
        if missing:
            raise ProfileError(f"{path}: targets.{tname} lacks {', '.join(missing)}")
        targets[tname] = TargetPin(
            name=tname, package=merged["package"],
            distribution=merged.get("distribution") or merged["package"],
            commit=merged["commit"], ref=merged["ref"], repository=merged.get("repository", ""),
            image_checkout=merged.get("image-checkout", ""))
    return targets


def load_profile(name_or_path: str, _seen: tuple = ()) -> Profile:
    path = profile_path(name_or_path)
    if path in _seen:
        raise ProfileError(f"profile {path} extends itself")
    data = _read_yaml(path, "profile")
    inherited: dict[str, TargetPin] = {}
    if data.get("extends"):
        inherited = load_profile(str(data["extends"]), _seen + (path,)).targets
    targets = _load_targets(data, path, inherited)
    if not targets:
        raise ProfileError(f"{path}: no targets")
    fixes = data.get("fixes") or []
    opt_in = data.get("opt-in") or []
    for key, names in (("fixes", fixes), ("opt-in", opt_in)):
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ProfileError(f"{path}: {key} must be a list of fix names")
    dupes = {n for n in fixes + opt_in if (fixes + opt_in).count(n) > 1}
    if dupes:
        raise ProfileError(f"{path}: fixes listed twice: {sorted(dupes)}")
    fixes_dir = (path.parent / data["fixes-dir"]).resolve() if data.get("fixes-dir") else FIXES_DIR
    profile = Profile(name=str(data.get("name") or path.stem), path=path, targets=targets,
                      fixes=fixes, opt_in=opt_in, fixes_dir=fixes_dir,
                      description=str(data.get("description", "")))
    for name in profile.all_fixes:
        if not (fixes_dir / name / "fix.yaml").exists():
            raise ProfileError(f"{path}: fix {name!r} has no {fixes_dir / name / 'fix.yaml'}")
    return profile


def load_fix(folder: Path, targets: dict[str, TargetPin]) -> Fix:
    meta_path = folder / "fix.yaml"
    meta = _read_yaml(meta_path, "fix metadata")
    for key in ("title", "targets"):
        if not meta.get(key):
            raise ProfileError(f"{meta_path}: missing {key!r}")
    fix_targets = meta["targets"]
    if not isinstance(fix_targets, list) or any(t not in targets for t in fix_targets):
        raise ProfileError(
            f"{meta_path}: targets must be a list drawn from {sorted(targets)}, found {fix_targets!r}")
    status = (meta.get("upstream") or {}).get("status")
    if status not in UPSTREAM_STATUSES:
        raise ProfileError(
            f"{meta_path}: upstream.status must be one of {sorted(UPSTREAM_STATUSES)}, found {status!r}")
    patches = []
    for entry in meta.get("patches") or []:
        missing = [k for k in ("target", "file", "base") if not entry.get(k)]
        if missing:
            raise ProfileError(f"{meta_path}: a patch entry lacks {', '.join(missing)}")
        if entry["target"] not in fix_targets:
            raise ProfileError(
                f"{meta_path}: patch for {entry['target']!r} but targets are {fix_targets}")
        patch_path = (folder / entry["file"]).resolve()
        if folder.resolve() not in patch_path.parents:
            raise ProfileError(f"{meta_path}: patch file {entry['file']!r} is outside {folder}")
        if not patch_path.is_file():
            raise ProfileError(f"{meta_path}: patch file {patch_path} does not exist")
        patches.append(PatchRef(target=entry["target"], path=patch_path, base=str(entry["base"]),
                                base_ref=str(entry.get("base-ref", ""))))
    return Fix(name=folder.name, folder=folder, title=str(meta["title"]), targets=fix_targets,
               patches=patches, requires=list(meta.get("requires") or []),
               conflicts=list(meta.get("conflicts") or []), meta=meta)
