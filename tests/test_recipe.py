"""The recipe says what the published page says, and names only fixes and knobs that exist."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
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


# --- the launch rendered from the recipe (recipes/launch.py) ----------------------------------------
from recipes.launch import cpu_serve_args, docker_run, launch_block, serve_command  # noqa: E402

SERVE_FLAGS_ARE_PARSED = r'''
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
args = parser.parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
print(json.dumps({"model": args.model_tag or engine.model, "tp": engine.tensor_parallel_size,
    "max_model_len": engine.max_model_len, "block_size": engine.block_size,
    "blocks": engine.num_gpu_blocks_override, "max_num_seqs": engine.max_num_seqs,
    "batched": engine.max_num_batched_tokens, "dtype": engine.dtype,
    "prompt_tokens_details": args.enable_prompt_tokens_details, "tool_parser": args.tool_call_parser,
    "reasoning_parser": engine.reasoning_parser, "prefix_caching": engine.enable_prefix_caching}))
'''


def _page_block(text: str) -> str:
    end_marker = "--reasoning-parser inkling_py"
    return text[text.index("export PT_HPU_LAZY_MODE"): text.index(end_marker) + len(end_marker)]


@pytest.mark.skipif(not PAGE.exists(), reason=f"the published page is not beside the repository ({PAGE})")
def test_rendered_launch_block_is_the_pages():
    rendered, page = launch_block(RECIPE), _page_block(PAGE.read_text())
    assert rendered == page, "\n".join(f"expected {p!r}, found {r!r}" for r, p in
                                       zip(rendered.splitlines(), page.splitlines()) if r != p) or "line count differs"


def test_docker_run_line_serves_the_recipe_on_gaudi():
    line = docker_run(RECIPE, image="inkling-small:port")
    argv = shlex.split(line.replace("\\\n", " "))
    for needed in ("--runtime=habana", "HABANA_VISIBLE_DEVICES=all", "--ipc=host",
                   f"COOKBOOK={RECIPE['image']['cookbook-path']}"):
        assert needed in argv, f"expected {needed} in the docker run line, found {argv}"
    envs = {argv[i + 1].split("=", 1)[0]: argv[i + 1].split("=", 1)[1] for i, a in enumerate(argv) if a == "-e"}
    assert {k: envs[k] for k in RECIPE["env"]} == RECIPE["env"]
    # the container runs bash -c SCRIPT: the fix step, then the serve command, whatever the base's ENTRYPOINT
    assert argv[argv.index("--entrypoint") + 1:argv.index("--entrypoint") + 4] == ["/bin/bash", "inkling-small:port", "-c"]
    script = argv[-1]
    fix, serve = script.split(" && exec ")
    assert fix + " || exit 1" == RECIPE["fix-step"]
    assert shlex.split(serve) == serve_command(RECIPE)


def _parse_with_vllm(vllm_src, argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(vllm_src), "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-c", SERVE_FLAGS_ARE_PARSED, json.dumps(argv)], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.slow
def test_the_pages_flags_pass_vllms_own_argument_parser(vllm_src):
    if PAGE.exists():
        _, serve, _ = _page_launch(PAGE.read_text())
        argv = serve_command({"serve": serve})
    else:
        argv = serve_command(RECIPE)
    assert argv[:2] == ["vllm", "serve"]
    proc = _parse_with_vllm(vllm_src, argv[2:])
    assert proc.returncode == 0, f"vLLM 0.30.0's parser refused the page's flags:\n{proc.stderr[-3000:]}"
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed == {"model": "thinkingmachines/Inkling-Small", "tp": 8, "max_model_len": 262144, "block_size": 128,
                      "blocks": 2560, "max_num_seqs": 16, "batched": 2048, "dtype": "bfloat16",
                      "prompt_tokens_details": True, "tool_parser": "inkling_py", "reasoning_parser": "inkling_py",
                      "prefix_caching": None}, parsed   # None: vLLM's default, on
    # the CPU variant's flags, as tools/cpu_server.py passes them
    proc = _parse_with_vllm(vllm_src, ["--model", "tiny"] + cpu_serve_args(RECIPE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cpu = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (cpu["max_model_len"], cpu["prompt_tokens_details"], cpu["prefix_caching"]) == (4096, True, True), cpu
    # the parser can refuse: a flag vLLM 0.30.0 does not have
    proc = _parse_with_vllm(vllm_src, argv[2:] + ["--max-num-sequences", "16"])
    assert proc.returncode == 2 and "unrecognized arguments: --max-num-sequences" in proc.stderr, proc.stderr[-500:]


def _readers(root: Path, name: str, pattern: str = "*.py") -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(pattern)
                  if p.is_file() and name.encode() in p.read_bytes())


def _vllm_readers(vllm_src: Path, name: str) -> list[str]:
    """vLLM's code that reads the variable. vllm/envs.py declares every variable vLLM knows (its
    parser and defaults), whether any code reads it or not: a declaration is not a read."""
    return [path for path in _readers(vllm_src / "vllm", name) if path != "envs.py"]


def test_unread_env_is_read_by_no_vllm_code(vllm_src):
    assert set(RECIPE["unread-env"]) <= set(RECIPE["env"])
    for name in RECIPE["unread-env"]:
        assert _vllm_readers(vllm_src, name) == [], f"{name} is read in vLLM 0.30.0: update unread-env"


def test_a_declaration_in_envs_py_is_not_a_read(vllm_src):
    """VLLM_ENGINE_ITERATION_TIMEOUT_S: vllm/envs.py declares it; nothing reads envs.VLLM_ENGINE_ITERATION_TIMEOUT_S."""
    assert "envs.py" in _readers(vllm_src / "vllm", "VLLM_ENGINE_ITERATION_TIMEOUT_S")
    assert _vllm_readers(vllm_src, "VLLM_ENGINE_ITERATION_TIMEOUT_S") == []
    assert "VLLM_ENGINE_ITERATION_TIMEOUT_S" in RECIPE["unread-env"]


def test_unread_env_is_read_by_no_vllm_gaudi_code(vllm_gaudi_src):
    for name in RECIPE["unread-env"]:
        found = _readers(vllm_gaudi_src / "vllm_gaudi", name)
        assert found == [], f"{name} is read by vllm-gaudi code {found}: update unread-env"
    # only docs and example scripts mention them
    for name in RECIPE["unread-env"]:
        assert all(p.startswith(("docs/", "examples/")) for p in _readers(vllm_gaudi_src, name, "*"))


def test_every_other_env_variable_is_read_somewhere(vllm_src, vllm_gaudi_src):
    port = REPO / "ports" / "inkling-small"
    for name in set(RECIPE["env"]) - set(RECIPE["unread-env"]):
        readers = (_vllm_readers(vllm_src, name) + _readers(vllm_gaudi_src / "vllm_gaudi", name)
                   + _readers(port / "inkling_hpu", name) + _readers(REPO / "fixes", name, "*.patch"))
        assert readers, f"{name} is set by the recipe but read by nothing: add it to unread-env"
