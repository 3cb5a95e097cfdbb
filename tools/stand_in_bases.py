"""Stand-ins for the stock vllm-gaudi base image, for the docker tests: made on this machine (no
image registry is reachable, and Habana's base image is not to be had here).

1. A Debian root filesystem from debootstrap, using the Debian mirror this machine's apt is
   configured with (read from the apt sources at run time), with python3, pip and git;
   `docker import`ed. The tarball is cached under the cookbook's cache folder (docker/).
2. On top of it, vLLM laid out as vllm-gaudi's stock image lays it out: the source tree at
   /workspace/vllm-project and the package in site-packages with a dist-info whose direct_url.json
   points at file:///workspace/vllm-project. This is a faithful stand-in for
   `VLLM_TARGET_DEVICE=empty pip install .` (the sdist's own vllm/_version.py is what
   setuptools-scm writes for that commit), made without building the wheel, which would need the
   network and a Rust toolchain.
3. vllm-gaudi the same way at /workspace/vllm-gaudi, at the commit the profile's vllm-gaudi patches
   are authored against: a real git checkout cloned from the repository named by VLLM_GAUDI_MIRROR,
   else the tree named by VLLM_GAUDI_SRC, else a stand-in package named as such that carries only
   version metadata.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import docker

from cookbook import upstream

REPO = Path(__file__).resolve().parents[1]
CACHE = upstream.CACHE_ROOT / "docker"
SITE_PACKAGES = "/usr/local/lib/python3.11/dist-packages"  # pip's target on Debian 12's python3
# For the CPU base (tools/cpu_base.py), what vLLM's CPU build needs beyond python (a Gaudi base has them):
# libnuma1, which its extension links, and g++ with Python's headers, with which torch.compile builds the
# sampler ops vLLM compiles on CPU (logprobs: "InvalidCxxCompiler", then "Python.h: No such file" without them).
ROOTFS_PACKAGES = ["python3", "python3-pip", "python3-setuptools", "python3-wheel", "git",
                   "ca-certificates", "libnuma1", "g++", "python3-dev"]
# The commit the profile's vllm-gaudi patches are authored against (main, the newest public source;
# the pin, releases/v0.30.0 at 058f107, is not public).
VLLM_GAUDI_TEST_COMMIT = upstream.vllm_gaudi_commit()
IMAGE_REPO = "gaudi-cookbook-test"
TRIMMED = ("./usr/share/locale/", "./usr/share/doc/", "./usr/share/man/", "./usr/share/info/")


class BaseImageError(RuntimeError):
    pass


# --- 1. Debian root filesystem ------------------------------------------------------------------

@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    keyring: str | None


def _os_release() -> dict:
    data = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        key, _, value = line.partition("=")
        data[key] = value.strip().strip('"')
    return data


def _apt_source_entries():
    """(uri, suites, components, signed_by) for every `deb` entry of the apt configuration."""
    apt = Path("/etc/apt")
    one_line = [apt / "sources.list"] + sorted((apt / "sources.list.d").glob("*.list"))
    for path in one_line:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            options = re.search(r"\[([^\]]*)\]", line)
            signed_by = None
            if options:
                for opt in options.group(1).split():
                    if opt.startswith("signed-by="):
                        signed_by = opt.split("=", 1)[1]
                line = line.replace(options.group(0), " ")
            words = line.split()
            if len(words) >= 3 and words[0] == "deb":
                yield words[1], [words[2]], words[3:], signed_by
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            if "deb" in fields.get("types", "").split() and fields.get("enabled", "yes") != "no":
                for uri in fields.get("uris", "").split():
                    yield (uri, fields.get("suites", "").split(),
                           fields.get("components", "").split(), fields.get("signed-by"))


def debian_mirror() -> AptSource:
    """The Debian mirror apt uses for this machine's own release (its main suite, not -security)."""
    codename = _os_release().get("VERSION_CODENAME")
    if _os_release().get("ID") != "debian" or not codename:
        raise BaseImageError("the docker test bases are made with debootstrap from a Debian host's "
                             f"apt mirror; this host is {_os_release().get('PRETTY_NAME')!r}")
    for uri, suites, components, signed_by in _apt_source_entries():
        if codename in suites and "main" in components:
            return AptSource(uri=uri, suite=codename, keyring=signed_by)
    raise BaseImageError(f"no apt source for suite {codename!r} with component main in /etc/apt")


def _run(cmd, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if proc.returncode != 0:
        raise BaseImageError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


def ensure_debootstrap():
    if shutil.which("debootstrap"):
        return
    _run(["apt-get", "install", "-y", "-q", "debootstrap"],
         env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"), timeout=900)


def rootfs_tarball() -> Path:
    """A cached tarball of a minimal Debian root filesystem with python3, pip and git."""
    source = debian_mirror()
    key = hashlib.sha256(json.dumps([source.uri, source.suite, ROOTFS_PACKAGES]).encode()).hexdigest()[:12]
    tarball = CACHE / f"debian-{source.suite}-{key}.tar"
    if tarball.exists():
        return tarball
    ensure_debootstrap()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="rootfs-") as tmp:
        root = Path(tmp) / "root"
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(ROOTFS_PACKAGES)}"]
        if source.keyring:
            cmd.append(f"--keyring={source.keyring}")
        _run(cmd + [source.suite, str(root), source.uri], timeout=1800)
        # Smaller image: no downloaded .debs or apt lists.
        shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
        (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)
        for lists in (root / "var/lib/apt/lists").glob("*_*"):
            lists.unlink()
        partial = tarball.with_suffix(".part")
        _run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(partial), "."])
        os.replace(partial, tarball)
    return tarball


# --- 2/3. vLLM and vllm-gaudi laid out as the stock image lays them out --------------------------

def _record_line(path: Path, rel: str) -> list[str]:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [rel, f"sha256={digest}", str(len(data))]


def write_dist_info(site: Path, package: str, distribution: str, version: str, checkout: str,
                    entry_points: str = "", summary: str = "") -> Path:
    """A dist-info as `pip install <checkout>` writes it (PEP 376 RECORD, PEP 610 direct_url.json)."""
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
        + (f"Summary: {summary}\n" if summary else ""))
    (info / "INSTALLER").write_text("pip\n")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: gaudi-cookbook tests\n"
                                "Root-Is-Purelib: true\nTag: py3-none-any\n")
    (info / "top_level.txt").write_text(package + "\n")
    (info / "direct_url.json").write_text(json.dumps({"url": f"file://{checkout}", "dir_info": {}}))
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)
    rows = []
    for path in sorted((site / package).rglob("*")) + sorted(info.iterdir()):
        if path.is_file():
            rows.append(_record_line(path, str(path.relative_to(site))))
    rows.append([f"{info.name}/RECORD", "", ""])
    with open(info / "RECORD", "w", newline="") as fh:
        csv.writer(fh, lineterminator="\n").writerows(rows)
    return info


def stage_vllm(stage: Path, vllm_tree: Path) -> str:
    """workspace/vllm-project + site-packages/vllm from an sdist tree; returns the version."""
    checkout = stage / "workspace" / "vllm-project"
    shutil.copytree(vllm_tree, checkout, symlinks=True)
    site = stage / "site-packages"
    shutil.copytree(vllm_tree / "vllm", site / "vllm", symlinks=True)
    version = re.search(r"__version__\s*=\s*version\s*=\s*'([^']+)'",
                        (vllm_tree / "vllm" / "_version.py").read_text()).group(1)
    egg_entry_points = vllm_tree / "vllm.egg-info" / "entry_points.txt"
    write_dist_info(site, "vllm", "vllm", f"{version}+empty", "/workspace/vllm-project",
                    egg_entry_points.read_text() if egg_entry_points.exists() else "")
    return version


def _setuptools_scm_version_file(version: str, commit: str) -> str:
    return (f"__version__ = version = {version!r}\n"
            f"__commit_id__ = commit_id = 'g{commit[:9]}'\n")


def _setup_py_entry_points(setup_py: Path) -> str:
    """The vllm.* entry-point groups declared in vllm-gaudi's setup.py, as entry_points.txt."""
    if not setup_py.exists():
        return ""
    text = []
    for group, body in re.findall(r'"(vllm\.[a-z_]+)":\s*\[([^\]]*)\]', setup_py.read_text()):
        text.append(f"[{group}]")
        text += [entry.replace(" ", "") .replace("=", " = ")
                 for entry in re.findall(r'"([^"]+)"', body)]
    return "\n".join(text) + "\n" if text else ""


def stage_vllm_gaudi(stage: Path, commit: str = VLLM_GAUDI_TEST_COMMIT) -> str:
    """workspace/vllm-gaudi + site-packages/vllm_gaudi; returns how it was made."""
    checkout = stage / "workspace" / "vllm-gaudi"
    site = stage / "site-packages"
    mirror, src = os.environ.get("VLLM_GAUDI_MIRROR"), os.environ.get("VLLM_GAUDI_SRC")
    version = f"0.0.0+g{commit[:9]}"  # vllm-gaudi's setup.py falls back to 0.0.0 without tags
    if mirror:
        _run(["git", "clone", "-q", "--no-checkout", mirror, str(checkout)], timeout=600)
        _run(["git", "-C", str(checkout), "-c", "advice.detachedHead=false", "checkout", "-q", commit])
        how = f"git clone of {mirror} at {commit[:9]}"
    elif src:
        shutil.copytree(src, checkout, symlinks=True, ignore=shutil.ignore_patterns(".git"))
        how = f"copy of VLLM_GAUDI_SRC={src} (recorded as {commit[:9]})"
    else:
        # Stand-in: only version metadata, so the commit checks have something to read.
        (checkout / "vllm_gaudi").mkdir(parents=True)
        (checkout / "STAND-IN.txt").write_text(
            "Stand-in for vllm-gaudi made by the cookbook's docker tests: version metadata only.\n")
        (checkout / "vllm_gaudi" / "__init__.py").write_text(
            '"""Stand-in for vllm-gaudi (docker tests): version metadata only."""\n')
        how = "stand-in package (version metadata only)"
    (checkout / "vllm_gaudi" / "_version.py").write_text(_setuptools_scm_version_file(version, commit))
    shutil.copytree(checkout / "vllm_gaudi", site / "vllm_gaudi", symlinks=True)
    entry_points = _setup_py_entry_points(checkout / "setup.py")
    write_dist_info(site, "vllm_gaudi", "vllm-gaudi", version, "/workspace/vllm-gaudi", entry_points,
                    summary="" if (mirror or src) else "STAND-IN for vllm-gaudi: version metadata only")
    return how


# What install.sh pip-installs from requirements/ (the library's and the preflight's).
INSTALL_REQUIREMENTS = [REPO / "requirements" / name for name in ("cookbook.txt", "preflight.txt")]


def _requirement_args() -> list[str]:
    return [arg for req in INSTALL_REQUIREMENTS for arg in ("-r", str(req))]


def _wheelhouse() -> Path:
    """Wheels of install.sh's requirements for the test base (its build has no network)."""
    key = hashlib.sha256(b"".join(req.read_bytes() for req in INSTALL_REQUIREMENTS)).hexdigest()[:12]
    house = CACHE / f"wheels-{key}"
    if not (house / ".complete").exists():
        shutil.rmtree(house, ignore_errors=True)
        _run(["python3", "-m", "pip", "download", "-q", "--only-binary", ":all:",
              "--python-version", "3.11", "--platform", "manylinux2014_x86_64",
              "-d", str(house), *_requirement_args()], timeout=900)
        (house / ".complete").touch()
    return house


def stage_install_requirements(stage: Path) -> None:
    """install.sh's requirements into the staged site-packages, as a stock image has them after
    install.sh ran once (the test base is made without network, so install.sh's pip finds them)."""
    _run(["python3", "-m", "pip", "install", "-q", "--no-index", "--no-compile",
          "--find-links", str(_wheelhouse()), "--target", str(stage / "site-packages"),
          *_requirement_args()], timeout=600)


def _tree_members(tree: Path, arcname: str) -> list[tuple[Path, str]]:
    members = [(tree, arcname)]
    for path in sorted(tree.rglob("*")):
        members.append((path, f"{arcname}/{path.relative_to(tree)}"))
    return members


# Where the stock image's checkouts are (its Dockerfile's ENV).
STOCK_ENV = {"VLLM_PATH": "/workspace/vllm-project", "VLLM_PATH2": "/workspace/vllm-gaudi"}


def import_base(stage: Path, tag: str, env: dict = STOCK_ENV) -> None:
    """One `docker import` of the Debian root filesystem plus the staged trees: a single layer and
    no intermediate containers (each of those is a full copy with the vfs storage driver)."""
    added = (_tree_members(stage / "workspace", "./workspace")
             + _tree_members(stage / "site-packages", "." + SITE_PACKAGES))
    names = {name for _path, name in added}
    with tempfile.NamedTemporaryFile(dir=CACHE, suffix=".tar") as combined:
        with tarfile.open(rootfs_tarball()) as src, tarfile.open(fileobj=combined, mode="w") as out:
            for member in src:
                if member.name.startswith(TRIMMED):
                    continue  # documentation and translations: smaller image, faster containers
                if member.name.rstrip("/") not in names:
                    out.addfile(member, src.extractfile(member) if member.isreg() else None)
            for path, name in added:
                info = out.gettarinfo(str(path), arcname=name)
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                if info.isreg():
                    with open(path, "rb") as fh:
                        out.addfile(info, fh)
                else:
                    out.addfile(info)
        combined.flush()
        changes = [arg for name, value in env.items() for arg in ("--change", f"ENV {name}={value}")]
        _run(["docker", "import", *changes, combined.name, tag], timeout=900)


def build_base(client: docker.DockerClient, vllm_tree: Path, tag: str,
               edit_installed: str | None = None) -> str:
    """Build (or reuse) a stock-layout base: vLLM from `vllm_tree`, vllm-gaudi as above.
    edit_installed: a file under site-packages to change after the "install" (a tampered base)."""
    if client.images.list(name=tag):
        return tag
    CACHE.mkdir(parents=True, exist_ok=True)  # a fresh machine has no cache folder yet
    with tempfile.TemporaryDirectory(prefix="cookbook-base-", dir=CACHE) as tmp:
        stage = Path(tmp)
        stage_vllm(stage, vllm_tree)
        stage_vllm_gaudi(stage)
        stage_install_requirements(stage)
        if edit_installed:
            edited = stage / "site-packages" / edit_installed
            edited.write_text(edited.read_text() + "\n# edited after install\n")
        import_base(stage, tag)
    return tag


def content_key(*parts) -> str:
    """Short hash naming a base image after everything that decides its contents."""
    source_text = Path(__file__).read_bytes()
    extra = [VLLM_GAUDI_TEST_COMMIT, os.environ.get("VLLM_GAUDI_MIRROR", ""), os.environ.get("VLLM_GAUDI_SRC", "")]
    return hashlib.sha256(source_text + json.dumps([*map(str, parts), *extra]).encode()).hexdigest()[:12]


def stock_layout_base(client: docker.DockerClient, vllm_version: str | None = None,
                      edit_installed: str | None = None) -> str:
    """The stand-in base of vLLM `vllm_version` (default: the profile's), built once and named after
    its contents; edit_installed as in build_base."""
    vllm_version = vllm_version or upstream.vllm_version()
    key = content_key(vllm_version, edit_installed)
    name = f"{IMAGE_REPO}/base-vllm-{vllm_version}{'-edited' if edit_installed else ''}:{key}"
    return build_base(client, upstream.vllm_source(vllm_version), name, edit_installed=edit_installed)
