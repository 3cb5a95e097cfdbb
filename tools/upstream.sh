# Sourced by the tools' shell scripts. `upstream ARGS` is `python3 -m cookbook.upstream ARGS` run from
# the repository root: the cache folder (--cache-root, COOKBOOK_CACHE), the vLLM version and the
# vllm-gaudi commit the default profile gives (--vllm-version, --vllm-gaudi-commit), or the cached
# vLLM sdist tree (no argument). cookbook/upstream.py holds the one definition of each. PYTHON names
# the interpreter (default python3; it needs PyYAML, as the fix-pack library does).
cookbook_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
upstream() { (cd "$cookbook_root" && "${PYTHON:-python3}" -m cookbook.upstream "$@"); }
