"""Pristine vs patched in one pytest session: run the same scenario against the vllm-gaudi tree named
by VLLM_GAUDI_SRC and against a copy with fixes applied by the project's fix-pack library."""
from __future__ import annotations

import json
from pathlib import Path

from .subproc import run_scenarios

_pristine_results: dict[tuple, dict] = {}  # per pytest process: pristine runs are shared between tests

SCENARIO_TIMEOUT = 600  # seconds per child process (imports ~15-40 s on a loaded 2-core machine)


def patched_tree(vllm_gaudi_src: Path, fixes: list[str], dest: Path) -> Path:
    """dest/vllm_gaudi with `fixes` applied (profile order) via cookbook.api.patched_copy."""
    from cookbook.api import patched_copy

    if not (dest / "vllm_gaudi").is_dir():
        patched_copy(Path(vllm_gaudi_src), "vllm-gaudi", list(fixes), dest)
    return dest


def run_pristine_and_patched(test_file: str, scenarios: list[str], fixes: str | list[str], vllm_gaudi_src: Path,
                             vllm_src: Path, workdir: Path, **kwargs) -> tuple[dict, dict]:
    """({scenario: result} on pristine, {scenario: result} on patched): one child process per tree."""
    fixes = [fixes] if isinstance(fixes, str) else list(fixes)
    pristine = pristine_results(test_file, scenarios, vllm_gaudi_src, vllm_src, **kwargs)
    patched_root = patched_tree(vllm_gaudi_src, fixes, Path(workdir) / ("patched-" + "-".join(fixes)))
    patched = run_scenarios(test_file, scenarios, patched_root, vllm_src, SCENARIO_TIMEOUT, kwargs)
    return pristine, patched


def pristine_results(test_file: str, scenarios: list[str], vllm_gaudi_src: Path, vllm_src: Path,
                     **kwargs) -> dict:
    """{scenario: result} on the pristine tree, computed once per pytest process."""
    key = (str(test_file), tuple(scenarios), str(vllm_gaudi_src), str(vllm_src), json.dumps(kwargs, sort_keys=True))
    if key not in _pristine_results:
        _pristine_results[key] = run_scenarios(test_file, scenarios, vllm_gaudi_src, vllm_src, SCENARIO_TIMEOUT,
                                               kwargs)
    return _pristine_results[key]
