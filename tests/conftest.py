"""tests/: this folder is on sys.path (pytest puts a conftest's folder there), so test modules
import the vllm-gaudi CPU harness as `gaudi_harness`. The shared fixtures are in ../conftest.py."""
