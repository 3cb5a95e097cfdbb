"""Checks of the image files that need no Docker engine."""
from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from builder import image, probe
from cookbook import api
from cookbook.profiles import load_profile
from tools import stand_in_bases

REPO = Path(__file__).resolve().parents[2]
PROFILES = Path(__file__).resolve().parent / "profiles"


def test_test_profiles_change_only_the_vllm_gaudi_pin():
    stock, test = api.load_profile("v0.30.0"), api.load_profile(str(PROFILES / "test-base.yaml"))
    assert (test.fixes, test.opt_in, test.fixes_dir) == (stock.fixes, stock.opt_in, stock.fixes_dir)
    assert test.targets["vllm"] == stock.targets["vllm"]
    # The docker tests' base carries the commit the vllm-gaudi patches are authored against.
    assert test.targets["vllm-gaudi"].commit == stock.targets["vllm-gaudi"].authored_against.commit
    assert stand_in_bases.VLLM_GAUDI_TEST_COMMIT == test.targets["vllm-gaudi"].commit
    port = api.load_profile(str(REPO / "ports/inkling-small/patches/port.yaml"))
    port_test = api.load_profile(str(PROFILES / "port-test-base.yaml"))
    assert (port_test.name, port_test.fixes, port_test.fixes_dir) == (port.name, port.fixes, port.fixes_dir)
    assert port_test.targets["vllm-gaudi"] == test.targets["vllm-gaudi"]


def test_stock_dockerfile_args_come_from_the_profile():
    dockerfile = (REPO / "Dockerfile").read_text()
    declared = set(re.findall(r"^ARG (\w+)\s*$", dockerfile, re.M))  # no default: must be given
    pins = image.base_buildargs(api.load_profile("v0.30.0"))
    assert declared == set(pins) | {"BASE_IMAGE"}
    profile = yaml.safe_load((REPO / "profiles/v0.30.0.yaml").read_text())
    assert pins["VLLM_COMMIT"] == profile["targets"]["vllm"]["commit"]
    assert pins["VLLM_GAUDI_COMMIT"] == profile["targets"]["vllm-gaudi"]["commit"]
    assert pins["GAUDI_SW_VERSION"] == str(profile["gaudi-sw"])
    # No second copy of a pin anywhere in the Dockerfiles.
    for path in ("Dockerfile", "ports/inkling-small/Dockerfile"):
        text = (REPO / path).read_text()
        assert pins["VLLM_COMMIT"][:7] not in text and pins["VLLM_GAUDI_COMMIT"] not in text


def test_probe_payload_is_what_the_probe_runs_and_nothing_else():
    """The payload (and so the probe cache's key) is the probe, the modules it imports and the targets asked
    about (with the profile's content manifest): an edit to the CLI or the series does not drop the cached probes."""
    profile = load_profile("v0.30.0")
    with tarfile.open(fileobj=io.BytesIO(probe.payload(profile))) as tar:
        names = tar.getnames()
        targets = json.load(tar.extractfile(probe.TARGETS_FILE))
    assert names == ["cookbook/__init__.py", "cookbook/probe.py", "cookbook/sources.py", "cookbook/gitcmd.py",
                     probe.TARGETS_FILE]
    content = targets["vllm"]["content"]
    assert content["blobs"] == profile.targets["vllm"].content.blobs()
    assert {"vllm/_version.py", "vllm/platforms/__init__.py", "vllm/v1/core/sched/scheduler.py"} <= set(content["skip"])
    assert "content" not in targets["vllm-gaudi"]
    names.remove(probe.TARGETS_FILE)
    imported = set()
    for name in names:
        text = (REPO / name).read_text()
        imported |= {m for pair in re.findall(r"^from \.(\w+) import|^from \. import (\w+)", text, re.M) for m in pair if m}
    assert {f"cookbook/{m}.py" for m in imported} <= set(names)
    assert probe.payload(profile) == probe.payload(profile)  # reproducible: the cache key is stable


def test_cli_help_documents_exit_codes():
    out = subprocess.run([sys.executable, "-m", "builder", "build", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    for code in ("2 base image mismatch", "4 Docker daemon unreachable", "5 base image not found",
                 "6 build failed", "7 preflight failed"):
        assert code in " ".join(out.split())


def test_short_help_and_missing_dependencies_are_one_line():
    out = subprocess.run([sys.executable, "-m", "builder", "build", "-h"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("Usage: python -m builder build"), out.stderr
    # a python without the library's packages (-S: no site-packages, so no click, docker, PyYAML)
    bare = subprocess.run([sys.executable, "-S", "-m", "builder", "-h"], cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 3 and bare.stdout == "", bare
    assert bare.stderr.count("\n") == 1 and bare.stderr.startswith("error: No module named "), bare.stderr
    assert f"install them with: pip install -r {REPO / 'requirements' / 'builder.txt'}" in bare.stderr


def test_base_args_cli_prints_build_arg_flags():
    out = subprocess.run([sys.executable, "-m", "builder", "base-args"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "--build-arg VLLM_COMMIT=ced6857afa0ea7b2e3f0846a62e1394e90f15607" in out


def test_port_image_sets_cookbook_where_it_copies_the_repository():
    """The page's launch block runs "$COOKBOOK/fixes/apply_all.py" inside the port image."""
    dockerfile = (REPO / "ports/inkling-small/Dockerfile").read_text()
    assert f"COPY . {image.IMAGE_HOME}\n" in dockerfile
    assert f"ENV COOKBOOK={image.IMAGE_HOME}\n" in dockerfile
