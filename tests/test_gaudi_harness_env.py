"""The harness starts each scenario from a known environment, wherever pytest runs."""
from pathlib import Path

from gaudi_harness.subproc import harness_env


def test_a_scenario_does_not_inherit_a_serving_containers_knobs(monkeypatch):
    """Inside a port container the server's INKLING_* and long-prefill variables are set (recipe.yaml);
    a scenario that runs without them (no bias budget, the stock scheduler) must not get them from there."""
    monkeypatch.setenv("INKLING_PREFILL_BIAS_BUDGET", "805306368")
    monkeypatch.setenv("VLLM_LONG_PREFILL_SHARE", "0.5")
    monkeypatch.setenv("VLLM_PLUGINS", "inkling_hpu")
    monkeypatch.setenv("COOKBOOK_PROFILE", "v0.30.0")
    env = harness_env(Path("/vllm-gaudi"), Path("/vllm"))
    assert "INKLING_PREFILL_BIAS_BUDGET" not in env and "VLLM_LONG_PREFILL_SHARE" not in env
    assert env["VLLM_PLUGINS"] == "hpu,01.hpu_custom_utils"
    assert env["COOKBOOK_PROFILE"] == "v0.30.0"   # what is not a serving knob passes through
