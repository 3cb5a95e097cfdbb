"""Helpers for tests/fixes/test_rank_exception_fatal.py: a real vLLM worker with a gloo TP group
and a scenario runner that drives a real MultiprocExecutor over it."""

# Carried by the planted exception, so a test can tell whether the caller saw rank 1's own error.
FAILURE_MARKER = "planted-failure-7f3a"
