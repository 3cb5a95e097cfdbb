"""Fetch and verify upstream source distributions from pip's configured index.

The index is whatever pip would use (PIP_INDEX_URL, pip's configuration, else pip's own
default), so users behind a mirror get their mirror. Downloads are cached under CACHE_ROOT
(COOKBOOK_CACHE, default ~/.cache/gaudi-cookbook: the one cache folder of the repository's tools)
and checked against a pinned sha256 before use. Which upstream sources the tests run against comes
from the default profile (vllm_version, vllm_gaudi_commit). The shell scripts ask here:

    python3 -m cookbook.upstream [VERSION...]     # the cached vLLM sdist trees (default: the profile's)
    python3 -m cookbook.upstream --cache-root | --vllm-version | --vllm-gaudi-commit
"""
from __future__ import annotations

import argparse
import hashlib
import html.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .profiles import DEFAULT_PROFILE, load_profile

# An unset or empty COOKBOOK_CACHE means the default (the shell's ${COOKBOOK_CACHE:-...} rule).
CACHE_ROOT = Path(os.environ.get("COOKBOOK_CACHE") or Path.home() / ".cache" / "gaudi-cookbook")


@dataclass(frozen=True)
class Sdist:
    project: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        return f"{self.project}-{self.version}.tar.gz"


# The pinned upstream sources the tests and `make check` run against, by version.
VLLM_SDISTS = {sdist.version: sdist for sdist in (
    Sdist("vllm", "0.30.0", "5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b"),
    # A known wrong base for the commit-check tests.
    Sdist("vllm", "0.26.0", "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"),
)}


class UpstreamError(RuntimeError):
    pass


def vllm_version(profile: str = DEFAULT_PROFILE) -> str:
    """The vLLM release a profile pins: its vllm target's tag without the v ("v0.30.0" -> "0.30.0")."""
    ref = load_profile(profile).targets["vllm"].ref
    if not ref.startswith("v") or not ref[1:].replace(".", "").isdigit():
        raise UpstreamError(f"profile {profile}: targets.vllm.ref {ref!r} is not a release tag (vX.Y.Z)")
    return ref[1:]


def vllm_gaudi_commit(profile: str = DEFAULT_PROFILE) -> str:
    """The vllm-gaudi commit the tests and `make check` run a profile's vllm-gaudi patches on: the
    target's `authored-against` commit (the pin itself when there is none)."""
    pin = load_profile(profile).targets["vllm-gaudi"]
    return (pin.authored_against or pin).commit


def pip_index_url() -> str:
    """The simple-index URL pip would use, without naming any host ourselves."""
    url = os.environ.get("PIP_INDEX_URL")
    if url:
        return url
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"],
            capture_output=True, text=True, check=False, timeout=60,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith(".index-url") and not key.strip().endswith("extra-index-url"):
            return value.strip().strip("'\"")
    from pip._internal.models.index import PyPI  # pip's own default index

    return PyPI.simple_url


class _LinkParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.links.append(href)


def _find_link(index_url: str, sdist: Sdist) -> str:
    page_url = index_url.rstrip("/") + f"/{sdist.project}/"
    with urllib.request.urlopen(page_url, timeout=120) as resp:
        parser = _LinkParser()
        parser.feed(resp.read().decode("utf-8", "replace"))
    for href in parser.links:
        name = urllib.parse.unquote(urllib.parse.urlsplit(href).path.rsplit("/", 1)[-1])
        if name == sdist.filename:
            return urllib.parse.urljoin(page_url, href)
    raise UpstreamError(f"{sdist.filename} is not listed on {page_url}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(sdist: Sdist) -> Path:
    """The verified sdist archive, downloaded once into the cache."""
    target = CACHE_ROOT / "sdists" / sdist.filename
    if target.exists() and _sha256(target) == sdist.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    url = _find_link(pip_index_url(), sdist)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        with urllib.request.urlopen(url, timeout=600) as resp:
            shutil.copyfileobj(resp, tmp)
    found = _sha256(Path(tmp.name))
    if found != sdist.sha256:
        os.unlink(tmp.name)
        raise UpstreamError(
            f"{sdist.filename}: sha256 mismatch: expected {sdist.sha256}, found {found}"
        )
    os.replace(tmp.name, target)
    return target


def extracted(sdist: Sdist) -> Path:
    """A pristine extracted tree of the sdist (cached; treat as read-only)."""
    root = CACHE_ROOT / "src" / f"{sdist.project}-{sdist.version}-{sdist.sha256[:12]}"
    tree = root / f"{sdist.project}-{sdist.version}"
    if (root / ".complete").exists():
        return tree
    archive = download(sdist)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    (root / ".complete").write_text(sdist.sha256 + "\n")
    return tree


def vllm_source(version: str | None = None) -> Path:
    """The pristine vLLM sdist tree of `version`, by default the one the default profile pins."""
    version = version or vllm_version()
    try:
        return extracted(VLLM_SDISTS[version])
    except KeyError:
        raise UpstreamError(
            f"no pinned vLLM sdist {version!r}; known: {', '.join(sorted(VLLM_SDISTS))}"
        ) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m cookbook.upstream",
                                     description="Print the cached vLLM sdist trees, or one fact below.")
    parser.add_argument("versions", nargs="*", metavar="VERSION",
                        help=f"vLLM versions (default: the one profile {DEFAULT_PROFILE} pins)")
    fact = parser.add_mutually_exclusive_group()
    fact.add_argument("--cache-root", action="store_true", help="the cache folder (COOKBOOK_CACHE)")
    fact.add_argument("--vllm-version", action="store_true", help="the vLLM version the profile pins")
    fact.add_argument("--vllm-gaudi-commit", action="store_true",
                      help="the vllm-gaudi commit the profile's patches are authored against")
    args = parser.parse_args(argv)
    if args.cache_root:
        print(CACHE_ROOT)
    elif args.vllm_version:
        print(vllm_version())
    elif args.vllm_gaudi_commit:
        print(vllm_gaudi_commit())
    else:
        for ver in args.versions or [vllm_version()]:
            print(vllm_source(ver))


if __name__ == "__main__":
    main()
