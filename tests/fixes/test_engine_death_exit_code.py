"""engine-death-exit-code: vLLM 0.30.0's real HTTP launcher (serve_http, uvicorn, its engine watchdog)
stopped by a dead engine, and by SIGTERM, in a process of its own (engine_death_exit_code_support/serve.py).

pristine: the watchdog stops the server when the engine died and the process exits 0, as after a clean
stop: a supervisor that restarts on failure (`Restart=on-failure`, `docker run --restart on-failure`) does
not restart it, and a script cannot tell a dead engine from `docker stop`.
patched: the same stop exits 1 and says why; SIGTERM still exits 0.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cookbook.api import patched_copy
from tools.cpu_server import free_port

FIXES_DIR = Path(__file__).resolve().parent
SERVE = FIXES_DIR / "engine_death_exit_code_support" / "serve.py"
# The launcher's watchdog looks every 5 s; start-up and shutdown take a few more.
STOP_WITHIN_SECONDS = 30
EXIT_LINE = "API server: exiting with code 1 because the engine died"

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def trees(vllm_src, tmp_path_factory):
    """{"pristine": sdist root, "patched": copy with the fix applied by the fix-pack library}."""
    dest = tmp_path_factory.mktemp("engine-death-exit-code")
    return {"pristine": vllm_src, "patched": patched_copy(vllm_src, "vllm", ["engine-death-exit-code"], dest)}


def serve(tree: Path, scenario: str) -> tuple[int, str, float]:
    """(exit code, output, seconds) of the launcher on `tree` in `scenario`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_TARGET_DEVICE="cpu", PYTHONPATH=str(tree))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SERVE), scenario, str(free_port())], env=env, capture_output=True,
                          text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_a_dead_engine_ends_the_server_with_a_failure(trees):
    code, output, seconds = serve(trees["pristine"], "engine-dies")
    assert code == 0 and seconds < STOP_WITHIN_SECONDS, (code, output[-3000:])     # the bug: a clean exit
    code, output, seconds = serve(trees["patched"], "engine-dies")
    assert code == 1 and seconds < STOP_WITHIN_SECONDS, (code, output[-3000:])
    assert EXIT_LINE in output, output[-3000:]


@pytest.mark.parametrize("name", ["pristine", "patched"])
def test_sigterm_still_ends_the_server_cleanly(trees, name):
    code, output, seconds = serve(trees[name], "sigterm")
    assert code == 0 and seconds < STOP_WITHIN_SECONDS, (code, output[-3000:])
    assert EXIT_LINE not in output
