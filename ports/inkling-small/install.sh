#!/usr/bin/env bash
# Install the Inkling-Small port into a stock vllm-gaudi releases/v0.30.0 image.
# Run by ports/inkling-small/Dockerfile with this repository at /opt/gaudi-cookbook:
#   1. the cookbook library's few requirements and what the preflight's CPU tests need beyond the
#      image (requirements/preflight.txt: pytest and its plugins, pinned; pip does nothing when they
#      are already there);
#   2. check the vLLM and vllm-gaudi commits with the library (`apply_all.py identify`): stop on
#      any other base;
#   3. install the inkling_hpu plugin (with its vllm.general_plugins entry point), no dependencies;
#   4. apply the port's vllm-gaudi patches (patches/port.yaml: decode-window, conv-snapshot-pages,
#      moe-routing-api) with
#      the same engine, which writes the stamp.
# Environment: COOKBOOK_PROFILE (default v0.30.0), COOKBOOK_PORT_PROFILE (default the port's
# patches/port.yaml), PYTHON (default python3).
# Exit codes (each failure says which step it stopped at):
#   0 installed;
#   1 the plugin install or a runner patch failed (step 1's requirements stay installed, and after a
#     runner patch's failure the plugin too; apply_all.py leaves vllm-gaudi's files unchanged);
#   2 not the profile's base: step 2 found other commits (step 1's requirements are installed, the port
#     is not), or step 4's commit check did (the plugin is installed, the runner patches are not);
#   3 setup or usage error: no Python or pip, the requirements could not be installed, or apply_all.py's
#     usage or profile error.
set -euo pipefail

cookbook=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
profile=${COOKBOOK_PROFILE:-v0.30.0}
port_profile=${COOKBOOK_PORT_PROFILE:-ports/inkling-small/patches/port.yaml}
python=${PYTHON:-python3}
# A container image's system Python is ours to install into (as the stock image's own pip installs are).
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
cd "$cookbook"

say() { echo "install.sh: $*"; }
die() {
  local code=$1
  shift
  echo "install.sh: ERROR: $*" >&2
  exit "$code"
}

command -v "$python" >/dev/null || die 3 "$python not found: this image has no Python"
"$python" -m pip --version >/dev/null 2>&1 || die 3 "pip is not available for $python"

say "cookbook at $cookbook; profile $profile; port series $port_profile"
say "[1/4] cookbook and preflight requirements"
"$python" -m pip install -q -r requirements/cookbook.txt -r requirements/preflight.txt ||
  die 3 "could not install requirements/cookbook.txt and requirements/preflight.txt"

say "[2/4] vLLM and vllm-gaudi commits"
set +e
"$python" fixes/apply_all.py identify --profile "$profile"
rc=$?
set -e
case $rc in
  0) ;;
  2) die 2 "this base is not the stock vllm-gaudi image profile $profile is pinned to (expected vs found above); the port was not installed (step 1's requirements were). Build on the right base (see docs/images.md)." ;;
  *) die "$rc" "could not identify the vLLM / vllm-gaudi commits (apply_all.py identify exit $rc)" ;;
esac

say "[3/4] inkling_hpu plugin"
"$python" -m pip install -q --no-deps --no-build-isolation ports/inkling-small ||
  die 1 "pip could not install the inkling_hpu plugin from ports/inkling-small"
rm -rf ports/inkling-small/build ports/inkling-small/*.egg-info  # in-tree build leftovers

say "[4/4] the port's vllm-gaudi patches (decode-window, conv-snapshot-pages, moe-routing-api)"
set +e
"$python" fixes/apply_all.py --profile "$port_profile"
rc=$?
set -e
case $rc in
  0) ;;
  2) die 2 "the runner patches refused this base (expected vs found above); the plugin is installed, the patches are not" ;;
  *) die "$rc" "the port's runner patches ($port_profile) did not apply (apply_all.py exit $rc)" ;;
esac
# Bytecode the build left behind is not part of the port.
find "$cookbook" -name __pycache__ -type d -prune -exec rm -rf {} +
say "install OK"
