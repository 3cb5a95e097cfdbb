"""Judge a base image by what is inside it, never by its tag or labels (labels are inherited and
can be stale): a throw-away container of the base (no network, read-only, no mounts) runs
`python3 -m cookbook.probe`, the same commit detection `apply_all.py` uses, and
`cookbook.api.check_probe` compares the answer with the profile. Answers are kept per image id."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import docker

from cookbook import api, series
from cookbook.profiles import REPO_ROOT, Profile
from cookbook.upstream import CACHE_ROOT

from .docker_io import Log, get_image, run_with_stdin, stderr_log
from .errors import BaseRefused, BuilderError

# What runs inside the base: the probe and what it imports (standard library only).
PROBE_MODULES = ("__init__.py", "probe.py", "sources.py", "gitcmd.py")
# Unpack the payload from stdin into the tmpfs, then run the probe module from there.
_UNPACK = ("import io, sys, tarfile; t = tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())); "
           "k = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}; "
           "t.extractall('/tmp/cookbook-probe', **k)")
_PROBE_SCRIPT = f'python3 -c "{_UNPACK}" && PYTHONPATH=/tmp/cookbook-probe exec python3 -B -m cookbook.probe "$1"'
PROBE_CACHE = CACHE_ROOT / "probes"
TARGETS_FILE = "targets.json"   # in the payload: a content manifest is too long for one argument


def _targets(profile: Profile) -> dict:
    """What the probe is asked about each target; a content pin's manifest goes with it (blobs, and the
    files it does not compare), for a build that records no commit."""
    targets = {}
    for name, pin in profile.targets.items():
        targets[name] = pin.as_probe_spec()
        if pin.content is not None:
            targets[name]["content"] = {"blobs": pin.content.blobs(), "skip": sorted(series.content_skip(profile, name))}
    return targets


def payload(profile: Profile) -> bytes:
    """The probe's modules and the targets' JSON (TARGETS_FILE) as an uncompressed tar (reproducible: fixed
    names, order and times)."""
    files = [(f"cookbook/{name}", (REPO_ROOT / "cookbook" / name).read_bytes()) for name in PROBE_MODULES]
    files.append((TARGETS_FILE, json.dumps(_targets(profile), sort_keys=True).encode()))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def probe_image(client: docker.DockerClient, image: str, profile: Profile, timeout: int = 300) -> dict:
    """What the image really contains, for the profile's targets (cookbook.probe's JSON)."""
    get_image(client, image)
    status, out, err = run_with_stdin(client, image, [_PROBE_SCRIPT, "probe", f"@/tmp/cookbook-probe/{TARGETS_FILE}"],
                                      payload(profile), timeout, tmpfs={"/tmp": "rw,size=64m"})
    if status != 0:
        raise BaseRefused(f"the probe could not run in {image!r} (exit {status}); the image needs "
                          f"python3 and sh. Its output:\n{(out + err).strip()[-3000:]}")
    try:
        return api.identify_by_content(profile, json.loads(out))
    except ValueError:
        raise BuilderError(f"the probe in {image!r} printed no JSON:\n{(out + err)[-3000:]}") from None


def _cache_path(image_id: str, profile: Profile) -> Path:
    """An image id is the digest of the image's config, which names every layer's content: the same
    id is the same files. The key also covers exactly what the probe runs and the targets asked about."""
    key = hashlib.sha256(payload(profile)).hexdigest()
    return PROBE_CACHE / f"{image_id.split(':')[-1][:32]}-{key[:16]}.json"


def check_base(client, image: str, profile: Profile, log: Log = stderr_log, use_cache: bool = True) -> dict:
    """The base's probe, or BaseRefused naming every problem (expected vs found)."""
    cache = _cache_path(get_image(client, image).id, profile)
    if use_cache and cache.exists():
        log(f"probe of {image}: result recorded for this image id ({cache.name}); not re-run")
        found = api.identify_by_content(profile, json.loads(cache.read_text()))
    else:
        log(f"probing {image} (throw-away container: no network, read-only, no mounts)")
        found = probe_image(client, image, profile)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(found, indent=2))
    for target, entry in found.items():
        log(f"  {target:<11} {str(entry.get('commit') or 'unidentified')[:12]:<12} {entry.get('how')}; "
            f"installed matches checkout: {entry.get('installed_matches_checkout')}")
    problems = api.check_probe(profile, found)
    if problems:
        raise BaseRefused(f"base image {image!r} is not the one profile {profile.name!r} is pinned to:\n  "
                          + "\n  ".join(problems), probe=found, problems=problems)
    log(f"base OK for profile {profile.name}")
    return found
