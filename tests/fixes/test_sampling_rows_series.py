"""The seven sampling-row fixes together: every regression test of the set, run against one tree
carrying all of them (profile order), must see its bug fixed, and no fix may undo another.

Pristine results are shared with the per-fix tests when they run in the same session.
"""
from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

from gaudi_harness.compare import run_pristine_and_patched

SAMPLING_ROW_FIXES = ["prompt-order", "sampling-rows-refresh", "structured-output-rows", "so-row-owners",
                      "bad-words-index", "logitsprocs-rows", "seeded-sampling"]
HERE = Path(__file__).resolve().parent
MODULES = ["test_" + name.replace("-", "_") + ".py" for name in SAMPLING_ROW_FIXES]


def _load(filename: str):
    spec = importlib.util.spec_from_file_location(f"_series_{Path(filename).stem}", HERE / filename)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def series_workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sampling_row_series")  # one patched copy, shared by all modules


@pytest.mark.slow
@pytest.mark.timeout(3000)
@pytest.mark.parametrize("filename", MODULES)
def test_each_fix_holds_with_the_whole_set(filename, vllm_gaudi_src, vllm_src, series_workdir):
    module = _load(filename)
    results = run_pristine_and_patched(str(HERE / filename), module.SCENARIOS, SAMPLING_ROW_FIXES, vllm_gaudi_src,
                                       vllm_src, series_workdir)
    checks = [f for name, f in inspect.getmembers(module, inspect.isfunction) if name.startswith("test_")]
    assert checks, filename
    for check in checks:
        check(results)
