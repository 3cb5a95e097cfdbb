"""`make image`: probe the base, refuse a mismatch, build the port image on it, label the result
(OCI annotations plus the profile, both commits, the fixes and the stamps' sha256) and run the
port's preflight inside it; and the stock base from the top-level Dockerfile with the profile's pins."""
from __future__ import annotations

import hashlib
import json
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker.errors

from cookbook.errors import UsageError
from cookbook.profiles import REPO_ROOT, Profile

from .docker_io import BuildResult, Log, build, connect, get_image, label_context, run_in_image, stderr_log
from .errors import BuildFailed, PreflightFailed
from .probe import check_base

PORT_DOCKERFILE = "ports/inkling-small/Dockerfile"
PORT_PROFILE = "ports/inkling-small/patches/port.yaml"
IMAGE_HOME = "/opt/gaudi-cookbook"  # where the port Dockerfile puts this repository
LABEL_NS = "gaudi-cookbook"


def read_stamps(client, image: str, profile: Profile) -> dict:
    """{target: {path, sha256, stamp}} of the image's patched packages (cookbook.stamp inside it)."""
    packages = {name: pin.package for name, pin in profile.targets.items()}
    status, out = run_in_image(client, image, f"cd {IMAGE_HOME} && python3 -m cookbook.stamp "
                                              + " ".join(packages.values()))
    if status != 0:
        raise BuildFailed(f"could not read the fix stamps in the new image:\n{out[-2000:]}")
    found = json.loads(out.strip().splitlines()[-1])
    return {name: found[package] for name, package in packages.items() if package in found}


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except OSError:
        return ""


def labels_for(profile, probe: dict, stamps: dict, base: str, base_id: str) -> dict:
    """OCI annotations plus the builder's own keys (the only labels worth trusting on the result)."""
    fixes = []
    for target_stamp in stamps.values():
        for prof in target_stamp["stamp"].get("profiles", {}).values():
            fixes += [f["name"] for f in prof.get("fixes", []) if f["name"] not in fixes]  # all applied
    labels = {
        "org.opencontainers.image.title": "Inkling-Small on Gaudi 2 (vLLM + vllm-gaudi)",
        "org.opencontainers.image.description": "The inkling_hpu port installed by install.sh on a "
                                                f"stock vllm-gaudi {profile.name} image",
        "org.opencontainers.image.revision": _git("rev-parse", "HEAD"),
        "org.opencontainers.image.created": _git("log", "-1", "--format=%cI"),
        "org.opencontainers.image.base.name": base,
        "org.opencontainers.image.base.digest": base_id,
        f"{LABEL_NS}.profile": profile.name,
        f"{LABEL_NS}.profile.sha256": hashlib.sha256(profile.path.read_bytes()).hexdigest(),
        f"{LABEL_NS}.source.dirty": "true" if _git("status", "--porcelain", "--untracked-files=no") else "false",
        f"{LABEL_NS}.fixes": ",".join(fixes),
    }
    source = _git("config", "--get", "remote.origin.url")
    if source and "@" not in source:  # never a URL that carries credentials
        labels["org.opencontainers.image.source"] = source
    for target, entry in probe.items():
        labels[f"{LABEL_NS}.{target}.commit"] = entry.get("checkout_commit") or entry.get("commit") or ""
    for target, target_stamp in stamps.items():
        labels[f"{LABEL_NS}.stamp.{target}.sha256"] = target_stamp["sha256"]
    labels[f"{LABEL_NS}.stamps"] = json.dumps(stamps, sort_keys=True, separators=(",", ":"))
    return {k: v for k, v in labels.items() if v}


def _stamps_from_previous(client, tag: str, built_id: str) -> dict | None:
    """The stamps recorded on TAG when TAG was labelled from this very build (same image id, same
    files): a rebuild with nothing changed then starts no container to read them again."""
    try:
        labels = client.images.get(tag).labels or {}
    except docker.errors.ImageNotFound:
        return None
    if labels.get(f"{LABEL_NS}.build.image") != built_id:
        return None
    stamps = json.loads(labels.get(f"{LABEL_NS}.stamps", "null") or "null")
    return stamps


def preflight(client, image: str, profile: str, port_profile: str, log: Log = stderr_log) -> dict:
    """The port's CPU preflight, run inside the new image."""
    log(f"preflight in {image[:19]} (no network)")
    status, out = run_in_image(
        client, image, f"cd {IMAGE_HOME} && python3 -m inkling_hpu.preflight --profile '{profile}' "
                       f"--port-profile '{port_profile}' --json")
    try:
        report = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise PreflightFailed(f"preflight printed no report (exit {status}):\n{out[-3000:]}") from None
    for check in report.get("checks", []):
        log(f"  {check['status']:<7} {check['name']}: {check['detail']}")
    if status != 0 or not report.get("ok"):
        raise PreflightFailed(f"preflight failed in the new image (exit {status})", preflight=report)
    return report


@dataclass
class ImageResult:
    tag: str
    image_id: str
    base: str
    profile: str
    probe: dict
    labels: dict
    build_seconds: float
    steps: int
    cached_steps: int
    cacheable_steps: int
    preflight: dict | None


def _in_image(profile: Profile, option: str) -> str:
    """The profile's path inside the image, which carries this repository and nothing else."""
    if REPO_ROOT not in profile.path.parents:
        raise UsageError(f"{option} {profile.path}: the image carries this repository, so a profile "
                         f"file must live inside it ({REPO_ROOT})")
    return str(profile.path.relative_to(REPO_ROOT))


def make_image(base: str, tag: str, profile: Profile, port_profile: Profile, run_preflight: bool = True,
               log: Log = stderr_log, client=None, nocache: bool = False,
               probe_cache: bool = True) -> ImageResult:
    """`make image`: probe the base, refuse a mismatch, build the port image, label, preflight."""
    in_image = {"COOKBOOK_PROFILE": _in_image(profile, "--profile"),
                "COOKBOOK_PORT_PROFILE": _in_image(port_profile, "--port-profile")}
    client = client or connect()
    base_image = get_image(client, base)
    found = check_base(client, base, profile, log, use_cache=probe_cache and not nocache)
    log(f"building {PORT_DOCKERFILE} on {base}")
    built = build(client, REPO_ROOT, PORT_DOCKERFILE, None, {"BASE": base, **in_image}, log=log,
                  nocache=nocache)
    # The preflight runs on the built image before labelling (labels change no file); it also
    # reports the stamps the labels name, so one container does both.
    report = None
    if run_preflight:
        report = preflight(client, built.image_id, in_image["COOKBOOK_PROFILE"],
                           in_image["COOKBOOK_PORT_PROFILE"], log)
        stamps = report.get("stamps", {})
    else:
        stamps = _stamps_from_previous(client, tag, built.image_id) or read_stamps(client, built.image_id, profile)
    labels = labels_for(profile, found, stamps, base, base_image.id)
    labels[f"{LABEL_NS}.build.image"] = built.image_id
    labelled = build(client, REPO_ROOT, "Dockerfile", tag, {"PARENT": built.image_id},
                     log=lambda line: None, fileobj=label_context(labels))
    log(f"labelled {tag} ({labelled.image_id[:19]}): {len(labels)} labels")
    return ImageResult(tag=tag, image_id=labelled.image_id, base=base, profile=profile.name, probe=found,
                       labels=labels, build_seconds=built.seconds + labelled.seconds,
                       steps=built.steps, cached_steps=built.cached_steps,
                       cacheable_steps=built.cacheable_steps, preflight=report)


def base_buildargs(profile: Profile) -> dict:
    """Build args of the top-level Dockerfile, from the profile (the only copy of the pins)."""
    args = {"COOKBOOK_PROFILE": profile.name,
            "GAUDI_SW_VERSION": profile.gaudi_sw}
    for name, prefix in (("vllm", "VLLM"), ("vllm-gaudi", "VLLM_GAUDI")):
        pin = profile.targets[name]
        args[f"{prefix}_REPOSITORY"] = pin.repository
        args[f"{prefix}_COMMIT"] = pin.commit
        args[f"{prefix}_REF"] = pin.ref
    return args


def build_stock_base(client, base_image: str, tag: str, profile: Profile,
                     vllm_src: Path | None = None, vllm_gaudi_src: Path | None = None,
                     log: Log = stderr_log) -> BuildResult:
    """The top-level Dockerfile with the profile's build args; local trees, when given, go into
    the build context as local-sources/<name> and replace the clones."""
    args = base_buildargs(profile)
    args["BASE_IMAGE"] = base_image
    get_image(client, base_image, "Habana PyTorch installer image")
    with tempfile.TemporaryFile() as context:
        with tarfile.open(fileobj=context, mode="w") as tar:
            tar.add(REPO_ROOT / "Dockerfile", arcname="Dockerfile")
            for name, tree in (("vllm-project", vllm_src), ("vllm-gaudi", vllm_gaudi_src)):
                if tree is not None:
                    log(f"{name}: local tree {tree}")
                    tar.add(tree, arcname=f"local-sources/{name}")
        context.seek(0)
        return build(client, REPO_ROOT, "Dockerfile", tag, args, log=log, fileobj=context)
