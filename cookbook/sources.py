"""Finding the code to patch and telling which commit it is. Standard library only, so that the
same code runs inside a bare base image (see probe.py) as in apply_all.py."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .gitcmd import blob_id, git

_COMMIT_ID = re.compile(r"""__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['"]g?([0-9a-f]{7,40})['"]""")
_VERSION = re.compile(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")
_LOCAL_SHA = re.compile(r"[+.]g([0-9a-f]{7,40})")


@dataclass
class Identity:
    commit: str | None  # None: nothing tells which commit this is
    how: str  # where the commit came from, for people
    evidence: dict = field(default_factory=dict)  # every record found, for the report and the probe


def locate(package: str) -> Path | None:
    """The directory holding the installed `package`, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve().parent


class UnreadableCheckout(Exception):
    """A git checkout is there but git cannot tell its HEAD: identification must stop, not fall
    back to a weaker record that may disagree with the code."""


def git_head(checkout: Path) -> str | None:
    """HEAD of a git checkout whose top is exactly `checkout` (never an enclosing repository);
    None when there is no checkout there. Git's ownership check is waived for this one read-only
    query (a stock image's checkout may belong to another user); any other failure raises."""
    if not (checkout / ".git").exists():
        return None
    try:
        out = git("-c", f"safe.directory={checkout}", "-C", str(checkout), "rev-parse", "--verify", "HEAD",
                  env={"GIT_CEILING_DIRECTORIES": str(checkout.parent)}, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UnreadableCheckout(f"git checkout at {checkout}: cannot run git ({exc})") from None
    if out.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40,64}", out.stdout.strip()):
        error = (out.stderr.strip().splitlines() or ["no commit"])[-1]
        raise UnreadableCheckout(f"git checkout at {checkout}: git cannot read its HEAD ({error})")
    return out.stdout.strip()


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def dist_info(root: Path, distribution: str) -> Path | None:
    wanted = _normalise(distribution)
    for entry in sorted(root.glob("*.dist-info")):
        if _normalise(entry.name.split("-")[0]) == wanted:
            return entry
    return None


def direct_url(root: Path, distribution: str) -> dict | None:
    info = dist_info(root, distribution)
    if info is None or not (info / "direct_url.json").exists():
        return None
    try:
        return json.loads((info / "direct_url.json").read_text())
    except (OSError, ValueError):
        return None


def url_to_path(url: str) -> Path | None:
    parts = urllib.parse.urlsplit(url)
    return Path(urllib.request.url2pathname(parts.path)) if parts.scheme == "file" else None


def version_file(root: Path, package: str) -> dict | None:
    path = root / package / "_version.py"
    try:
        text = path.read_text()
    except OSError:
        return None
    record: dict = {"path": str(path)}
    if m := _VERSION.search(text):
        record["version"] = m.group(1)
    if m := _COMMIT_ID.search(text):
        record["commit"] = m.group(1)
    elif "version" in record and (m := _LOCAL_SHA.search(record["version"])):
        record["commit"] = m.group(1)
    return record


def identify(root: Path, package: str, distribution: str) -> Identity:
    """The commit of the code under `root`: a git checkout at the root, else the checkout the
    installed distribution was built from (direct_url.json), else the generated _version.py.
    A checkout that is there but unreadable stops identification (commit None): a later record
    may name the pin while the code is another commit's."""
    evidence: dict = {}
    try:
        head = git_head(root)
        if head:
            evidence["checkout"] = {"path": str(root), "commit": head}
        url = direct_url(root, distribution)
        url_commit = None
        if url:
            evidence["direct_url"] = url
            vcs = url.get("vcs_info") or {}
            if vcs.get("commit_id"):
                url_commit = (vcs["commit_id"], f"direct_url.json vcs_info of {distribution}")
            elif not head and (src := url_to_path(url.get("url", ""))) and (src_head := git_head(src)):
                evidence["installed_from"] = {"path": str(src), "commit": src_head}
                url_commit = (src_head, f"direct_url.json -> git checkout {src}")
    except UnreadableCheckout as exc:
        return Identity(None, f"cannot identify: {exc}", evidence)
    version = version_file(root, package)
    if version:
        evidence["version_file"] = version
    if head:
        return Identity(head, f"git checkout at {root}", evidence)
    if url_commit:
        return Identity(url_commit[0], url_commit[1], evidence)
    if version and version.get("commit"):
        return Identity(version["commit"], f"{package}/_version.py commit id", evidence)
    return Identity(None, "no git checkout, direct_url.json commit or _version.py commit id found",
                    evidence)


def differing_files(root: Path, blobs: dict[str, str], skip: set[str]) -> list[str]:
    """Paths (relative to root) whose file is missing or not the blob the manifest names."""
    out = []
    for rel, blob in sorted(blobs.items()):
        if rel in skip:
            continue
        path = root / rel
        if not path.is_file() or path.is_symlink() or blob_id(path.read_bytes()) != blob:
            out.append(rel)
    return out


def checkout_head(checkout: Path) -> str | None:
    """git_head for a report: an unreadable checkout reads as unidentified, never as a commit."""
    try:
        return git_head(checkout)
    except UnreadableCheckout:
        return None
