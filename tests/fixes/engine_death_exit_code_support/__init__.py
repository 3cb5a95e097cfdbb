"""Helpers for tests/fixes/test_engine_death_exit_code.py."""
