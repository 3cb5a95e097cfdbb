#!/usr/bin/env bash
# Print a vllm-gaudi source tree to test against, or nothing.
# VLLM_GAUDI_SRC wins; else, when a clone of vllm-project/vllm-gaudi is on this machine
# (VLLM_GAUDI_MIRROR, a bare or normal git directory), the tree of main at 091bbadd is exported from
# it once into the cache. Nothing here downloads anything.
set -euo pipefail
if [ -n "${VLLM_GAUDI_SRC:-}" ]; then echo "$VLLM_GAUDI_SRC"; exit 0; fi
commit=091bbadd
mirror=${VLLM_GAUDI_MIRROR:-/work/.mirror/vllm-project+vllm-gaudi/repo}
[ -d "$mirror" ] || exit 0
tree=${COOKBOOK_CACHE:-$HOME/.cache/gaudi-cookbook}/vllm-gaudi-$commit
if [ ! -f "$tree/.complete" ]; then
  rm -rf "$tree" && mkdir -p "$tree"
  git --git-dir "$mirror" archive "$commit" | tar -x -C "$tree"
  touch "$tree/.complete"
fi
echo "$tree"
