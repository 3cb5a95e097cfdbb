"""habana_stub: a CPU stand-in for Intel's habana_frameworks package (not available off Gaudi).

It provides only the names vllm-gaudi touches when its input batch and model runner are imported and
driven on CPU; see tests/gaudi_harness/README.md for the list and the reason for each name.
"""
