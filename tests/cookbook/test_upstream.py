"""cookbook.upstream: the one cache folder and the upstream sources the profile names, as Python and
the shell scripts (tools/upstream.sh) see them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from cookbook import upstream
from cookbook.profiles import load_profile
from cookbook_trees import REPO


def shell(*args: str, **env: str) -> str:
    """`upstream ARGS` as the tools' shell scripts run it."""
    environ = {k: v for k, v in os.environ.items() if k != "COOKBOOK_CACHE"}
    return subprocess.run(["bash", "-c", 'source tools/upstream.sh && upstream "$@"', "upstream", *args],
                          cwd=REPO, env={**environ, "PYTHON": sys.executable, **env}, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.parametrize("value", [None, "", "/tmp/elsewhere"], ids=["unset", "empty", "set"])
def test_cache_root_is_cookbook_cache_or_the_default(value):
    env = {} if value is None else {"COOKBOOK_CACHE": value}
    expected = value or os.path.join(os.path.expanduser("~"), ".cache", "gaudi-cookbook")
    assert shell("--cache-root", **env) == expected


def test_the_profiles_versions_are_what_the_scripts_get():
    profile = load_profile("v0.30.0")
    assert f"v{upstream.vllm_version()}" == profile.targets["vllm"].ref
    assert upstream.vllm_version() in upstream.VLLM_SDISTS  # a pinned sdist to test against
    assert upstream.vllm_gaudi_commit() == profile.targets["vllm-gaudi"].authored_against.commit
    assert shell("--vllm-version") == upstream.vllm_version()
    assert shell("--vllm-gaudi-commit") == upstream.vllm_gaudi_commit()
