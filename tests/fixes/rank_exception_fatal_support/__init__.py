"""Helpers for tests/fixes/test_rank_exception_fatal.py: a real vLLM worker with a gloo TP group
and a scenario runner that drives a real MultiprocExecutor over it."""
