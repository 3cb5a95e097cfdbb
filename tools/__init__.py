"""Development helpers shared by the tests, the benchmarks and the Makefile (not installed).

Imported as `tools.<module>` with the repository root on the path (pytest: pyproject's
pythonpath; scripts: `python -m tools.cpu_server ...` run from the repository root)."""
