#!/usr/bin/env bash
# Print a vllm-gaudi source tree (the commit the vllm-gaudi patches are written against: the default
# profile's vllm-gaudi `authored-against`, main at 091bbadd) to test against, or nothing; say on
# stderr, in one line, which source it used or why there is none.
#   1. VLLM_GAUDI_SRC: a tree, used as it is.
#   2. VLLM_GAUDI_MIRROR: a clone of vllm-project/vllm-gaudi (bare or not) on this machine.
#   3. Otherwise the commit is fetched from VLLM_GAUDI_URL (default: the public repository) into the
#      cache, when the network allows.
# A tree is exported once into the cache ($COOKBOOK_CACHE, default ~/.cache/gaudi-cookbook).
set -euo pipefail
source "$(dirname "$0")/upstream.sh"
say() { echo "vllm-gaudi source: $*" >&2; }

if [ -n "${VLLM_GAUDI_SRC:-}" ]; then
  say "VLLM_GAUDI_SRC=$VLLM_GAUDI_SRC"
  echo "$VLLM_GAUDI_SRC"
  exit 0
fi
commit=$(upstream --vllm-gaudi-commit)
cache=$(upstream --cache-root)
tree=$cache/vllm-gaudi-${commit:0:8}
if [ -f "$tree/.complete" ]; then
  say "$tree (cached export of ${commit:0:8})"
  echo "$tree"
  exit 0
fi

# Git must not read the user's configuration or prompt for credentials here.
export GIT_TERMINAL_PROMPT=0 GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null
if [ -n "${VLLM_GAUDI_MIRROR:-}" ]; then
  gitdir=$VLLM_GAUDI_MIRROR
  [ -d "$gitdir/.git" ] && gitdir=$gitdir/.git
  if ! git --git-dir "$gitdir" cat-file -e "$commit^{commit}" 2>/dev/null; then
    say "none: VLLM_GAUDI_MIRROR=$VLLM_GAUDI_MIRROR has no commit ${commit:0:8}; the vllm-gaudi tests skip"
    exit 0
  fi
  from="clone $VLLM_GAUDI_MIRROR"
else
  url=${VLLM_GAUDI_URL:-https://github.com/vllm-project/vllm-gaudi}
  gitdir=$cache/vllm-gaudi.git
  mkdir -p "$cache"
  [ -d "$gitdir" ] || git init -q --bare "$gitdir"
  if ! err=$(timeout 600 git --git-dir "$gitdir" fetch -q --depth 1 "$url" "$commit" 2>&1); then
    say "none: VLLM_GAUDI_SRC and VLLM_GAUDI_MIRROR unset and $url cannot be fetched ($(echo "$err" | tail -n 1)); the vllm-gaudi tests skip"
    exit 0
  fi
  from="fetched from $url"
fi
rm -rf "$tree" "$tree.part" && mkdir -p "$tree.part"
git --git-dir "$gitdir" archive "$commit" | tar -x -C "$tree.part"
touch "$tree.part/.complete"
mv "$tree.part" "$tree"
say "$tree (${commit:0:8}, $from)"
echo "$tree"
