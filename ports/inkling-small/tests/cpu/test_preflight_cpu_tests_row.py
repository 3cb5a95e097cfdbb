"""The preflight's CPU-tests row says why pytest died: the signal by name, where, and its stderr (the row once
read `CPU tests fail ()`: an AVX2 machine's SIGILL left pytest's stdout empty). Real pytest processes, run by
the preflight's own runner on a folder of tests made here."""
from __future__ import annotations

from pathlib import Path

from inkling_hpu import preflight


def folder_of_one_test(tmp_path: Path, test_module: str) -> Path:
    tests = tmp_path / "tests" / "cpu"
    tests.mkdir(parents=True)
    (tests / "test_dies.py").write_text(test_module)
    return tests


def test_a_signal_while_collecting_is_named_with_the_module_and_stderr(tmp_path):
    tests = folder_of_one_test(tmp_path, "import os\nimport signal\n\nos.kill(os.getpid(), signal.SIGILL)\n")
    status, detail = preflight.run_cpu_tests(tests)
    assert status == "fail", detail
    assert detail.startswith("pytest killed by SIGILL (Illegal instruction) while collecting tests/cpu/test_dies.py:4;"), detail
    assert "stderr: Fatal Python error: Illegal instruction" in detail, detail


def test_a_signal_inside_a_test_names_the_test(tmp_path):
    tests = folder_of_one_test(tmp_path, "import os\nimport signal\n\n\ndef test_one():\n    os.kill(os.getpid(), signal.SIGSEGV)\n")
    status, detail = preflight.run_cpu_tests(tests)
    assert status == "fail", detail
    assert detail.startswith("pytest killed by SIGSEGV (Segmentation fault) while in tests/cpu/test_dies.py:6 (test_one);"), detail


def test_a_tally_stays_the_row(tmp_path):
    tests = folder_of_one_test(tmp_path, "def test_one():\n    assert False\n\n\ndef test_two():\n    pass\n")
    status, detail = preflight.run_cpu_tests(tests)
    assert status == "fail", detail
    assert detail.startswith("1 failed, 1 passed"), detail
    assert detail.endswith("test_dies.py::test_one"), detail


def test_the_caller_s_pytest_addopts_do_not_change_the_row(tmp_path, monkeypatch):
    """-v in the caller's PYTEST_ADDOPTS turned the tally into pytest's verbose banner line."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "-v")
    tests = folder_of_one_test(tmp_path, "def test_one():\n    pass\n")
    status, detail = preflight.run_cpu_tests(tests)
    assert status == "pass", detail
    assert detail.startswith("1 passed in "), detail
