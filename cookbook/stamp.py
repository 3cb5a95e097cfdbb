"""The stamp: `<package>/cookbook-fixes.json`, the record of what a patched package carries
(profile, commits found, fixes, patch sha256s). The one place that names, reads and writes it;
the series, the builder and the port's preflight all go through here.

    python3 -m cookbook.stamp PACKAGE...   prints {package: {path, sha256, stamp}} for the installed
                                           packages that carry a stamp (the builder runs it in images)
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from .errors import FixRefused

NAME = "cookbook-fixes.json"


def path(root: Path, package: str) -> Path:
    return Path(root) / package / NAME


def _check_shape(stamp) -> None:
    if not isinstance(stamp, dict) or set(stamp) - {"profiles"} or not isinstance(stamp.get("profiles", {}), dict):
        raise ValueError('expected a JSON object with one key, "profiles", an object')
    for name, entry in stamp.get("profiles", {}).items():
        fixes = entry.get("fixes", []) if isinstance(entry, dict) else None
        if not isinstance(fixes, list) or not all(isinstance(f, dict) for f in fixes):
            raise ValueError(f'profile {name!r}: expected an object whose "fixes" is a list of objects')


def read(stamp_path: Path) -> dict:
    """A package's stamp, {} when there is none; refuses one that is not the fix pack's own (a
    stamp records what the tree carries: a run cannot guess around a damaged one)."""
    if not stamp_path.exists():
        return {}
    try:
        stamp = json.loads(stamp_path.read_text())
        _check_shape(stamp)
    except (OSError, ValueError) as exc:
        raise FixRefused(f"{stamp_path} is not a fix-pack stamp ({exc}); it records what the tree "
                         "carries, so the run cannot trust it: move it aside only if the tree is "
                         "pristine") from None
    return stamp


def fixes_recorded(stamp: dict, profile_name: str) -> list[str]:
    """Names of the fixes the stamp records as applied under this profile."""
    entry = stamp.get("profiles", {}).get(profile_name) or {}
    return [f.get("name") for f in entry.get("fixes", [])]


def updated(old: dict, profile_name: str, entry: dict | None) -> bytes | None:
    """The stamp's new bytes with this profile's entry replaced (None: removed); None when no
    profile is left, so the file goes."""
    stamp = json.loads(json.dumps(old))  # a copy
    profiles = stamp.setdefault("profiles", {})
    if entry is None:
        profiles.pop(profile_name, None)
    else:
        profiles[profile_name] = entry
    return (json.dumps(stamp, indent=2, sort_keys=True) + "\n").encode() if profiles else None


def installed(packages: list[str]) -> dict:
    """{package: {path, sha256, stamp}} for the importable packages that carry a stamp (found
    without importing them)."""
    import importlib.util

    out = {}
    for package in packages:
        spec = importlib.util.find_spec(package)
        if not spec or not spec.submodule_search_locations:
            continue
        found = Path(list(spec.submodule_search_locations)[0]) / NAME
        if found.exists():
            data = found.read_bytes()
            out[package] = {"path": str(found), "sha256": hashlib.sha256(data).hexdigest(),
                            "stamp": read(found)}
    return out


if __name__ == "__main__":
    print(json.dumps(installed(sys.argv[1:])))
