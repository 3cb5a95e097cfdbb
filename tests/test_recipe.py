"""The recipe says what the published page says, and names only fixes and knobs that exist."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from cookbook.api import load_profile

REPO = Path(__file__).resolve().parents[1]
RECIPE = yaml.safe_load((REPO / "recipes/thinkingmachines/Inkling-Small/recipe.yaml").read_text())
PAGE = REPO.parent / "shared" / "seeds" / "cookbook-page-inkling-small-gaudi2.txt"


def test_recipe_fixes_exist_in_its_profile():
    profile = load_profile(RECIPE["profile"])
    assert set(RECIPE["opt-in-fixes"]) <= set(profile.opt_in)
    assert profile.plan(RECIPE["opt-in-fixes"])[0][-1].name == "vllm-long-prefill-share"
    assert RECIPE["fix-step"].endswith(f"--profile {profile.name} {' '.join(RECIPE['opt-in-fixes'])} || exit 1")


def test_long_prefill_variables_are_declared_by_their_fix():
    fix = load_profile(RECIPE["profile"]).fix("vllm-long-prefill-share")
    declared = {entry["name"] for entry in fix.meta.get("env") or []}
    used = {k for k in RECIPE["env"] if k.startswith("VLLM_LONG_PREFILL")}
    assert used <= declared, f"not declared in fix.yaml env: {used - declared}"


def test_kv_pool_is_the_pages_memory_guard():
    serve = dict(a.split("=", 1) for a in RECIPE["serve"] if "=" in a)
    blocks, block = int(serve["--num-gpu-blocks-override"]), int(serve["--block-size"])
    assert blocks * block == RECIPE["kv-pool-tokens"] == 327680
    assert RECIPE["kv-pool-tokens"] >= int(serve["--max-model-len"]) == RECIPE["context"]


def _page_launch(text: str):
    env = dict(re.findall(r"export (\w+)=(\S+)", text))  # the page runs lines together
    serve = text[text.index("vllm serve thinkingmachines/Inkling-Small"):]
    serve = serve[: serve.index("$COOKBOOK is")] if "$COOKBOOK is" in serve else serve
    tokens = serve.replace("\\\n", " ").split()
    args, i = [], 3
    while i < len(tokens) and tokens[i].startswith("--"):
        if i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            args.append(f"{tokens[i]}={tokens[i + 1]}")
            i += 2
        else:
            args.append(tokens[i])
            i += 1
    fix_step = re.search(r"^python3 .*apply_all\.py.*$", text, re.M).group(0)
    return env, tokens[:3] + args, fix_step


@pytest.mark.skipif(not PAGE.exists(), reason=f"the published page is not beside the repository ({PAGE})")
def test_recipe_matches_the_published_launch_block():
    env, serve, fix_step = _page_launch(PAGE.read_text())
    assert env == RECIPE["env"]
    assert serve == RECIPE["serve"]
    assert fix_step == RECIPE["fix-step"]
