"""Benchmarks, run as modules from the repository root: `python -m benchmarks.<name>` (`make bench`
runs them all; those of the port need PYTHONPATH=ports/inkling-small)."""
