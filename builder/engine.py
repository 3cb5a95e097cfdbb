"""Probe a base image, build the port image on it, label it and run its preflight (docker SDK).

The base is judged by what is inside it, never by its tag or labels (labels are inherited and can
be stale): a throw-away container of the base runs `python3 -m cookbook.probe`, the same commit
detection `apply_all.py` uses, and `cookbook.api.check_probe` compares that with the profile.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import docker
import docker.errors

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cookbook import api  # noqa: E402
from cookbook.errors import EXIT_BASE_MISMATCH, EXIT_OK, EXIT_USAGE, CookbookError  # noqa: E402,F401

PORT_DOCKERFILE = "ports/inkling-small/Dockerfile"
PORT_PROFILE = "ports/inkling-small/patches/port.yaml"
IMAGE_HOME = "/opt/gaudi-cookbook"
LABEL_NS = "gaudi-cookbook"
STAMP = "cookbook-fixes.json"

# Exit codes (documented in docs/images.md and `python3 -m builder --help`); 0, 2 (base mismatch)
# and 3 (usage or profile error) mean what they mean for apply_all.py.
EXIT_ERROR = 1  # anything unexpected
EXIT_DAEMON = 4  # the Docker daemon cannot be reached
EXIT_BASE_MISSING = 5  # the base image is not in the local engine
EXIT_BUILD_FAILED = 6  # the Dockerfile build failed
EXIT_PREFLIGHT = 7  # the new image was built but its preflight failed

EXIT_CODES_HELP = ("Exit codes: 0 success; 1 unexpected error; 2 base image mismatch (its vLLM / "
                   "vllm-gaudi commits or installed files are not the profile's); 3 usage or profile "
                   "error; 4 Docker daemon unreachable; 5 base image not found; 6 build failed; "
                   "7 preflight failed in the new image.")


class BuilderError(Exception):
    exit_code = EXIT_ERROR

    def __init__(self, message: str, **details):
        super().__init__(message)
        self.details = details


class DaemonDown(BuilderError):
    exit_code = EXIT_DAEMON


class BaseMissing(BuilderError):
    exit_code = EXIT_BASE_MISSING


class BaseRefused(BuilderError):
    exit_code = EXIT_BASE_MISMATCH


class BuildFailed(BuilderError):
    exit_code = EXIT_BUILD_FAILED


class PreflightFailed(BuilderError):
    exit_code = EXIT_PREFLIGHT


class Usage(BuilderError):
    exit_code = EXIT_USAGE


Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- engine connection ----------------------------------------------------------------------------

def connect(timeout: int = 600) -> docker.DockerClient:
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except docker.errors.DockerException as exc:
        raise DaemonDown(f"cannot reach the Docker daemon at {where}: {exc}. Start dockerd (or the "
                         "docker service) or point DOCKER_HOST at a running daemon.") from None
    return client


def get_image(client: docker.DockerClient, name: str, what: str = "base image"):
    try:
        return client.images.get(name)
    except docker.errors.ImageNotFound:
        raise BaseMissing(f"{what} {name!r} is not in the local Docker engine (see `docker images`); "
                          "build or pull it first. The builder never pulls: the base is judged by "
                          "its contents, so it must be the exact image you mean.") from None
    except docker.errors.APIError as exc:
        raise BuilderError(f"cannot inspect {what} {name!r}: {exc}") from None


def load_profile(profile: str):
    try:
        return api.load_profile(profile)
    except CookbookError as exc:
        raise Usage(str(exc)) from None


# --- probe ----------------------------------------------------------------------------------------

# Runs inside the base with nothing but python3: unpack the cookbook package from stdin into the
# tmpfs, then run the probe module from there.
_UNPACK = ("import io, sys, tarfile; t = tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())); "
           "k = {'filter': 'data'} if hasattr(tarfile, 'data_filter') else {}; "
           "t.extractall('/tmp/cookbook-probe', **k)")
_PROBE_SCRIPT = f'python3 -c "{_UNPACK}" && PYTHONPATH=/tmp/cookbook-probe exec python3 -B -m cookbook.probe "$1"'


def cookbook_tar() -> bytes:
    """The cookbook/ package (sources only) as an uncompressed tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted((REPO / "cookbook").glob("*.py")):
            tar.add(path, arcname=f"cookbook/{path.name}")
    return buf.getvalue()


def _run_with_stdin(client, image: str, command: list[str], payload: bytes, timeout: int,
                    tmpfs: dict) -> tuple[int, str, str]:
    """Run a throw-away container with no network, a read-only root and no mounts; feed payload
    to its stdin; return (exit status, stdout, stderr)."""
    host_config = client.api.create_host_config(network_mode="none", read_only=True, tmpfs=tmpfs,
                                                auto_remove=False)
    container = client.api.create_container(image, command=command, entrypoint=["sh", "-c"],
                                            stdin_open=True, network_disabled=True,
                                            host_config=host_config, user="0", working_dir="/")
    cid = container["Id"]
    try:
        sock = client.api.attach_socket(cid, params={"stdin": 1, "stream": 1})
        client.api.start(cid)
        raw = getattr(sock, "_sock", sock)
        raw.sendall(payload)
        raw.shutdown(socket.SHUT_WR)  # EOF on the container's stdin
        status = client.api.wait(cid, timeout=timeout)["StatusCode"]
        sock.close()
        out = client.api.logs(cid, stdout=True, stderr=False).decode("utf-8", "replace")
        err = client.api.logs(cid, stdout=False, stderr=True).decode("utf-8", "replace")
        return status, out, err
    finally:
        client.api.remove_container(cid, force=True)


def probe_image(client: docker.DockerClient, image: str, profile: str, timeout: int = 300) -> dict:
    """What the image really contains, for the profile's targets (cookbook.probe's JSON)."""
    get_image(client, image)
    targets = {name: pin.as_probe_spec() for name, pin in load_profile(profile).targets.items()}
    status, out, err = _run_with_stdin(
        client, image, [_PROBE_SCRIPT, "probe", json.dumps(targets)], cookbook_tar(), timeout,
        tmpfs={"/tmp": "rw,size=64m"})
    if status != 0:
        raise BaseRefused(f"the probe could not run in {image!r} (exit {status}); the image needs "
                          f"python3 and sh. Its output:\n{(out + err).strip()[-3000:]}")
    try:
        return json.loads(out)
    except ValueError:
        raise BuilderError(f"the probe in {image!r} printed no JSON:\n{(out + err)[-3000:]}") from None


def judge(profile: str, probe: dict) -> list[str]:
    """Problems with the base (empty: it is the profile's)."""
    return api.check_probe(load_profile(profile), probe)


PROBE_CACHE = Path(os.environ.get("COOKBOOK_CACHE", Path.home() / ".cache" / "gaudi-cookbook")) / "probes"


def _probe_cache_path(image_id: str, profile: str) -> Path:
    """An image id is the digest of the image's config, which names every layer's content: the same
    id is the same files. The key also covers the probe's code and the targets asked about."""
    targets = {name: pin.as_probe_spec() for name, pin in load_profile(profile).targets.items()}
    key = hashlib.sha256(cookbook_tar() + json.dumps(targets, sort_keys=True).encode()).hexdigest()
    return PROBE_CACHE / f"{image_id.split(':')[-1][:32]}-{key[:16]}.json"


def check_base(client, image: str, profile: str, log: Log = stderr_log, use_cache: bool = True) -> dict:
    cache = _probe_cache_path(get_image(client, image).id, profile)
    if use_cache and cache.exists():
        log(f"probe of {image}: result recorded for this image id ({cache.name}); not re-run")
        found = json.loads(cache.read_text())
    else:
        log(f"probing {image} (throw-away container: no network, read-only, no mounts)")
        found = probe_image(client, image, profile)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(found, indent=2))
    for target, entry in found.items():
        log(f"  {target:<11} {str(entry.get('commit') or 'unidentified')[:12]:<12} {entry.get('how')}; "
            f"installed matches checkout: {entry.get('installed_matches_checkout')}")
    problems = judge(profile, found)
    if problems:
        raise BaseRefused(f"base image {image!r} is not the one profile {profile!r} is pinned to:\n  "
                          + "\n  ".join(problems), probe=found, problems=problems)
    log(f"base OK for profile {profile}")
    return found


# --- build ----------------------------------------------------------------------------------------

@dataclass
class BuildResult:
    image_id: str
    seconds: float
    steps: int = 0
    cached_steps: int = 0
    cacheable_steps: int = 0  # steps after FROM (FROM and the ARGs before it are never "cached")
    log: list[str] = field(default_factory=list)


def build(client, context: Path, dockerfile: str, tag: str | None, buildargs: dict,
          labels: dict | None = None, log: Log = stderr_log, fileobj=None,
          nocache: bool = False) -> BuildResult:
    """Build and stream the log: each step with the seconds since the start, cache hits marked."""
    start = time.monotonic()
    result = BuildResult(image_id="", seconds=0.0)
    kwargs = dict(fileobj=fileobj, custom_context=True) if fileobj is not None else dict(path=str(context))
    try:
        stream = client.api.build(dockerfile=dockerfile, tag=tag, buildargs=buildargs, labels=labels,
                                  rm=True, forcerm=True, pull=False, decode=True, nocache=nocache,
                                  **kwargs)
        pending = ""
        seen_from = False
        for chunk in stream:
            if "error" in chunk:
                raise BuildFailed(f"build of {dockerfile} failed: {chunk['error'].strip()}",
                                  log=result.log[-50:])
            if "aux" in chunk and "ID" in chunk["aux"]:
                result.image_id = chunk["aux"]["ID"]
            text = pending + chunk.get("stream", "")
            *lines, pending = text.split("\n")
            for line in lines:
                result.log.append(line)
                stamp = f"[{time.monotonic() - start:6.1f}s]"
                if line.startswith("Step "):
                    result.steps += 1
                    instruction = line.split(" : ", 1)[-1].split(" ", 1)[0].upper()
                    if instruction == "FROM":
                        seen_from = True
                    elif seen_from:
                        result.cacheable_steps += 1
                    log(f"{stamp} {line}")
                elif line.strip() == "---> Using cache":
                    result.cached_steps += 1
                    log(f"{stamp}   (cached)")
                elif line.strip().startswith("--->") or not line.strip():
                    continue
                else:
                    log(f"{stamp}   | {line}")
    except docker.errors.APIError as exc:
        raise BuildFailed(f"build of {dockerfile} failed: {exc.explanation or exc}") from None
    if not result.image_id:
        raise BuildFailed(f"build of {dockerfile} ended without an image id", log=result.log[-50:])
    result.seconds = time.monotonic() - start
    log(f"[{result.seconds:6.1f}s] built {result.image_id[:19]} ({result.steps} steps, "
        f"{result.cached_steps} of {result.cacheable_steps} cacheable from cache)")
    return result


def _run_in_image(client, image: str, script: str, timeout: int = 600) -> tuple[int, str]:
    """Run a shell script in a throw-away container of the image (no network); (status, output)."""
    host_config = client.api.create_host_config(network_mode="none", tmpfs={"/tmp": "rw,size=256m"})
    cid = client.api.create_container(image, command=[script], entrypoint=["sh", "-c"],
                                      network_disabled=True, host_config=host_config)["Id"]
    try:
        client.api.start(cid)
        status = client.api.wait(cid, timeout=timeout)["StatusCode"]
        return status, client.api.logs(cid).decode("utf-8", "replace")
    finally:
        client.api.remove_container(cid, force=True)


_READ_STAMPS = """python3 - <<'EOF'
import hashlib, importlib.util, json, pathlib
out = {}
for target, package in json.loads('%s').items():
    spec = importlib.util.find_spec(package)
    if spec and spec.submodule_search_locations:
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / 'cookbook-fixes.json'
        if path.exists():
            data = path.read_bytes()
            out[target] = {'path': str(path), 'sha256': hashlib.sha256(data).hexdigest(),
                           'stamp': json.loads(data)}
print(json.dumps(out))
EOF"""


def read_stamps(client, image: str, profile) -> dict:
    packages = {name: pin.package for name, pin in profile.targets.items()}
    status, out = _run_in_image(client, image, _READ_STAMPS % json.dumps(packages))
    if status != 0:
        raise BuildFailed(f"could not read the fix stamps in the new image:\n{out[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _git(*args) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=60).stdout.strip()
    except OSError:
        return ""


def labels_for(profile, probe: dict, stamps: dict, base: str, base_id: str) -> dict:
    """OCI annotations plus the builder's own keys (the only labels worth trusting on the result)."""
    fixes = []
    for target_stamp in stamps.values():
        for prof in target_stamp["stamp"].get("profiles", {}).values():
            fixes += [f["name"] for f in prof.get("fixes", [])
                      if f.get("status") in ("applied", "patched", "already applied") and f["name"] not in fixes]
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


def _label_context(parent: str) -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = b"ARG PARENT\nFROM $PARENT\n"
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf


def preflight(client, image: str, profile: str, port_profile: str, log: Log = stderr_log) -> dict:
    """The port's CPU preflight, run inside the new image (builder/preflight.py there)."""
    log(f"preflight in {image[:19]} (no network)")
    status, out = _run_in_image(
        client, image, f"python3 {IMAGE_HOME}/builder/preflight.py --profile '{profile}' "
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


def make_image(base: str, tag: str, profile: str = "v0.30.0", port_profile: str = PORT_PROFILE,
               run_preflight: bool = True, log: Log = stderr_log, client=None,
               nocache: bool = False, probe_cache: bool = True) -> ImageResult:
    """`make image`: probe the base, refuse a mismatch, build the port image, label, preflight."""
    prof = load_profile(profile)
    load_profile(port_profile)
    for given, name in ((profile, "--profile"), (port_profile, "--port-profile")):
        path = Path(given)
        if path.suffix in (".yaml", ".yml") and REPO not in path.resolve().parents:
            raise Usage(f"{name} {given}: the image carries this repository, so a profile file must "
                        f"live inside it ({REPO})")
    client = client or connect()
    base_image = get_image(client, base)
    found = check_base(client, base, profile, log, use_cache=probe_cache and not nocache)
    in_image = lambda p: p if not p.endswith((".yaml", ".yml")) else str(Path(p).resolve().relative_to(REPO))  # noqa: E731
    log(f"building {PORT_DOCKERFILE} on {base}")
    built = build(client, REPO, PORT_DOCKERFILE, None,
                  {"BASE": base, "COOKBOOK_PROFILE": in_image(profile),
                   "COOKBOOK_PORT_PROFILE": in_image(port_profile)}, log=log, nocache=nocache)
    # The preflight runs on the built image before labelling (labels change no file); it also
    # reports the stamps the labels name, so one container does both.
    report = None
    if run_preflight:
        report = preflight(client, built.image_id, in_image(profile), in_image(port_profile), log)
        stamps = report.get("stamps", {})
    else:
        stamps = _stamps_from_previous(client, tag, built.image_id) or read_stamps(client, built.image_id, prof)
    labels = labels_for(prof, found, stamps, base, base_image.id)
    labels[f"{LABEL_NS}.build.image"] = built.image_id
    labelled = build(client, REPO, "Dockerfile", tag, {"PARENT": built.image_id}, labels=labels,
                     log=lambda line: None, fileobj=_label_context(built.image_id))
    log(f"labelled {tag} ({labelled.image_id[:19]}): {len(labels)} labels")
    return ImageResult(tag=tag, image_id=labelled.image_id, base=base, profile=prof.name, probe=found,
                       labels=labels, build_seconds=built.seconds + labelled.seconds,
                       steps=built.steps, cached_steps=built.cached_steps,
                       cacheable_steps=built.cacheable_steps, preflight=report)


def base_buildargs(profile: str) -> dict:
    """Build args of the top-level Dockerfile, from the profile (the only copy of the pins)."""
    prof = load_profile(profile)
    import yaml

    args = {"COOKBOOK_PROFILE": prof.name,
            "GAUDI_SW_VERSION": str(yaml.safe_load(prof.path.read_text()).get("gaudi-sw", ""))}
    for name, prefix in (("vllm", "VLLM"), ("vllm-gaudi", "VLLM_GAUDI")):
        pin = prof.targets[name]
        args[f"{prefix}_REPOSITORY"] = pin.repository
        args[f"{prefix}_COMMIT"] = pin.commit
        args[f"{prefix}_REF"] = pin.ref
    return args


def build_stock_base(client, base_image: str, tag: str, profile: str = "v0.30.0",
                     vllm_src: Path | None = None, vllm_gaudi_src: Path | None = None,
                     log: Log = stderr_log) -> BuildResult:
    """The top-level Dockerfile with the profile's build args; local trees, when given, go into
    the build context as local-sources/<name> and replace the clones."""
    import tempfile

    args = base_buildargs(profile)
    args["BASE_IMAGE"] = base_image
    get_image(client, base_image, "Habana PyTorch installer image")
    with tempfile.TemporaryFile() as context:
        with tarfile.open(fileobj=context, mode="w") as tar:
            tar.add(REPO / "Dockerfile", arcname="Dockerfile")
            for name, tree in (("vllm-project", vllm_src), ("vllm-gaudi", vllm_gaudi_src)):
                if tree is not None:
                    log(f"{name}: local tree {tree}")
                    tar.add(tree, arcname=f"local-sources/{name}")
        context.seek(0)
        return build(client, REPO, "Dockerfile", tag, args, log=log, fileobj=context)
