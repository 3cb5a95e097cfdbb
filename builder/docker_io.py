"""Docker I/O for the builder (Docker Engine API through the docker SDK): the connection,
throw-away containers with no network, and builds whose log a person can follow."""
from __future__ import annotations

import io
import os
import socket
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import docker
import docker.errors

from .errors import BaseMissing, BuilderError, BuildFailed, DaemonDown

Log = Callable[[str], None]


def stderr_log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


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


def run_with_stdin(client, image: str, command: list[str], payload: bytes, timeout: int,
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


@dataclass
class BuildResult:
    image_id: str
    seconds: float
    steps: int = 0
    cached_steps: int = 0
    cacheable_steps: int = 0  # steps after FROM (FROM and the ARGs before it are never "cached")
    log: list[str] = field(default_factory=list)


def build(client, context: Path, dockerfile: str, tag: str | None, buildargs: dict,
          log: Log = stderr_log, fileobj=None,
          nocache: bool = False) -> BuildResult:
    """Build and stream the log: each step with the seconds since the start, cache hits marked."""
    start = time.monotonic()
    result = BuildResult(image_id="", seconds=0.0)
    kwargs = dict(fileobj=fileobj, custom_context=True) if fileobj is not None else dict(path=str(context))
    try:
        stream = client.api.build(dockerfile=dockerfile, tag=tag, buildargs=buildargs,
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


def run_in_image(client, image: str, script: str, timeout: int = 600) -> tuple[int, str]:
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


def _dockerfile_quote(text: str) -> str:
    """A double-quoted Dockerfile word: backslashes, quotes and `$` (variable expansion) escaped."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def label_context(labels: dict) -> io.BytesIO:
    """A build context whose Dockerfile adds every label in ONE instruction on top of $PARENT. The build
    API's `labels` option adds one instruction per label, and each is a container: with the vfs storage
    driver a full copy of the image, about a minute each on a vLLM base of 2 GB."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        label = " \\\n      ".join(f"{_dockerfile_quote(k)}={_dockerfile_quote(v)}" for k, v in sorted(labels.items()))
        data = f"ARG PARENT\nFROM $PARENT\nLABEL {label}\n".encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    buf.seek(0)
    return buf
