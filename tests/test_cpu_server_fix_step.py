"""tools/cpu_server.py's fix step refuses like the page's launch (`apply_all.py … || exit 1`): a vLLM
that is not the pin stops the server before it starts, with apply_all.py's refusal; no other path
patches it."""
from __future__ import annotations

import shutil

import pytest

from tools import cpu_server


def test_a_vllm_that_is_not_the_pin_stops_the_server(vllm_src, tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    shutil.copytree(vllm_src / "vllm", site / "vllm")
    # the v0.30.0 files, but installed as another commit's build: every fix would still apply
    (site / "vllm" / "_version.py").write_text("__version__ = '0.30.1'\n__commit_id__ = '0123456789ab'\n")
    before = (site / "vllm" / "envs.py").read_bytes()
    with pytest.raises(cpu_server.FixPackRefused) as refused:
        cpu_server.patch_vllm(tmp_path / "venv")
    assert "apply_all.py exit 2" in str(refused.value) and "REFUSED (exit 2)" in str(refused.value)
    assert "0123456789ab" in str(refused.value) and "ced6857a" in str(refused.value)
    assert (site / "vllm" / "envs.py").read_bytes() == before     # nothing patched
    assert not (site / "vllm" / "cookbook-fixes.json").exists()
