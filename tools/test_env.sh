#!/usr/bin/env bash
# Create (once) and print the path of the cached test virtualenv.
# Its name carries a hash of everything that decides its contents, so a changed requirement
# builds a new one and an unchanged one is reused across clones.
set -euo pipefail
source "$(dirname "$0")/upstream.sh"
here=$cookbook_root
python=${PYTHON:-python3}
torch_pin="torch==2.13.0"
vllm_src=$(upstream)  # the vLLM sdist the profile pins
key=$( { "$python" --version; echo "$torch_pin"; cat "$here/requirements/cookbook.txt" "$here/requirements/builder.txt" "$here/requirements/test.txt" "$vllm_src/requirements/common.txt"; } | sha256sum | cut -c1-12)
venv=$(upstream --cache-root)/venv-$key
if [ ! -f "$venv/.complete" ]; then
  echo "test_env: building $venv (torch CPU + ${vllm_src##*/} requirements, about 2.6 GB; minutes, once; pip says what it installs)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --progress-bar off "$torch_pin" >&2
  "$venv/bin/pip" install --progress-bar off "$torch_pin" -r "$vllm_src/requirements/common.txt" -r "$here/requirements/test.txt" >&2
  # PyPI's torchvision/torchaudio are CUDA builds that break transformers next to torch CPU.
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$venv/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" >&2
  touch "$venv/.complete"
fi
# The venv imports the profile's vLLM sdist (the port's model is built from vLLM's layers), by a .pth:
# appended to sys.path, after PYTHONPATH and the checkout's own folders, so a tree a test names comes first.
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ "$(cat "$site/vllm-sdist.pth" 2>/dev/null)" = "$vllm_src" ] || echo "$vllm_src" > "$site/vllm-sdist.pth"
echo "$venv"
