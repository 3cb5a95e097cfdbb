"""Run a scenario function in a fresh process against a chosen vllm-gaudi tree (pristine or patched).

Importing this module imports nothing from vLLM / vllm-gaudi, so the pytest process stays clean and
one session can compare trees. A scenario is a module-level function of a test file (which must not
import vLLM at module level); it takes JSON keyword arguments and returns something JSON-serialisable.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterable

HARNESS_PARENT = Path(__file__).resolve().parent.parent  # the directory holding gaudi_harness/
RESULT_MARK = "GAUDI_HARNESS_RESULT:"
# The vLLM plugins the harness's entry points declare: vllm-gaudi's platform and its utilities.
HARNESS_PLUGINS = ("hpu", "01.hpu_custom_utils")
SERVER_KNOB_PREFIXES = ("INKLING_", "VLLM_LONG_PREFILL_")


def harness_env(vllm_gaudi_root: Path, vllm_root: Path) -> dict[str, str]:
    """Environment for a scenario process: harness, vllm-gaudi tree, vLLM sdist tree on PYTHONPATH."""
    # Not the serving knobs of the caller's environment (a port container sets the page's INKLING_* and
    # long-prefill variables for its server): a scenario sets the ones it tests.
    env = {k: v for k, v in os.environ.items() if not k.startswith(SERVER_KNOB_PREFIXES)}
    harness = HARNESS_PARENT / "gaudi_harness"
    # The repository's root last: scenario modules import its library (recipes, tools) wherever pytest runs
    # (the image's preflight runs it from /tmp).
    env["PYTHONPATH"] = os.pathsep.join(
        str(p) for p in (HARNESS_PARENT, harness / "habana_stub", harness / "entry_points", harness / "cpu_kernels",
                         vllm_gaudi_root, vllm_root, HARNESS_PARENT.parent))
    env.pop("VLLM_TARGET_DEVICE", None)  # "cpu" would force vLLM's CpuPlatform over the HPU plugin
    env.update({
        "VLLM_USE_FAKE_HPU": "1",  # vllm-gaudi: cpu device strings, gloo backend
        "PT_HPU_LAZY_MODE": "0",
        "VLLM_SKIP_WARMUP": "true",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    })
    # Only the plugins the harness declares (entry_points/): where the port and vllm-gaudi are installed too
    # (the port image), theirs would join, and the port is the code under test, put on the path by the caller.
    env["VLLM_PLUGINS"] = ",".join(HARNESS_PLUGINS)
    return env


def run_scenarios(test_file: str, names: list[str], vllm_gaudi_root: Path, vllm_root: Path,
                  timeout: float = 600, kwargs: dict | None = None,
                  python_path: Iterable[str | Path] = ()) -> dict[str, object]:
    """Run the functions `names` of `test_file` (each with `kwargs`) in ONE child process against
    `vllm_gaudi_root`; return {name: JSON result}. `python_path`: the code under test (e.g. the
    port's tree), put first on the child's sys.path after the bootstrap, so that vLLM's plugin
    discovery at bootstrap sees only the upstream trees and the stub (an installed-looking
    egg-info in that tree would otherwise register it as a plugin). A scenario that raises gives
    {"harness_error": "<Type>: <message>", "traceback": ...} so one failure does not hide the others.
    Raises RuntimeError with the child's output if the child produced no result at all."""
    code = ("import sys, json; from gaudi_harness.subproc import _child_main; "
            "_child_main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4]))")
    proc = subprocess.run([sys.executable, "-c", code, str(test_file), json.dumps(list(names)),
                           json.dumps(kwargs or {}), json.dumps([str(p) for p in python_path])],
                          env=harness_env(Path(vllm_gaudi_root), Path(vllm_root)),
                          capture_output=True, text=True, timeout=timeout)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    raise RuntimeError(f"scenarios {names} of {test_file} produced no result (exit {proc.returncode})\n"
                       f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")


def run_scenario(scenario: str, vllm_gaudi_root: Path, vllm_root: Path, timeout: float = 600,
                 python_path: Iterable[str | Path] = (), **kwargs) -> object:
    """`file.py::function(**kwargs)` in a child process (`python_path` as in run_scenarios); its
    result, or RuntimeError if it raised."""
    path, _, name = scenario.partition("::")
    if not name:
        raise ValueError(f"scenario must be 'file.py::function', found {scenario!r}")
    result = run_scenarios(path, [name], vllm_gaudi_root, vllm_root, timeout, kwargs, python_path)[name]
    if isinstance(result, dict) and "harness_error" in result:
        raise RuntimeError(f"{scenario} raised {result['harness_error']}\n{result['traceback']}")
    return result


def _child_main(test_file: str, names: list[str], kwargs: dict, python_path: list[str] = ()) -> None:
    import importlib.util
    import traceback

    from gaudi_harness import bootstrap
    bootstrap.install()
    sys.path[:0] = python_path    # the code under test, after vLLM's plugin discovery (run_scenarios)
    spec = importlib.util.spec_from_file_location(f"_scenarios_{Path(test_file).stem}", test_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {}
    for name in names:
        try:
            results[name] = getattr(module, name)(**kwargs)
        except Exception as e:  # reported to the test, which decides
            results[name] = {"harness_error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    print(RESULT_MARK + json.dumps(results), flush=True)
