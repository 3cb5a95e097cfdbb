"""Render the launch from a recipe.yaml, the one source of it: the page's launch block (env, fix
step, `vllm serve`), a `docker run` line for a Gaudi node, and the CPU variant's server flags.

    python3 -m recipes.launch block  [RECIPE]     # the page's launch block
    python3 -m recipes.launch docker [RECIPE] [--image IMAGE] [--hf-cache DIR]
    python3 -m recipes.launch cpu    [RECIPE]     # the CPU variant's api_server arguments

RECIPE defaults to recipes/thinkingmachines/Inkling-Small/recipe.yaml. Needs PyYAML only.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

RECIPE = Path(__file__).resolve().parent / "thinkingmachines" / "Inkling-Small" / "recipe.yaml"


def load_recipe(path: Path | str = RECIPE) -> dict:
    return yaml.safe_load(Path(path).read_text())


def _flag_lines(args: list[str]) -> list[str]:
    """`--flag=value` -> `--flag value`, as the page writes them."""
    return [" ".join(a.split("=", 1)) if a.startswith("--") else a for a in args]


def serve_command(recipe: dict) -> list[str]:
    """The serve command as argv: `vllm serve MODEL --flag value ...`."""
    argv = []
    for arg in recipe["serve"]:
        argv += arg.split("=", 1) if arg.startswith("--") else [arg]
    return argv


def serve_flags(recipe: dict) -> dict[str, str]:
    """The serve command's `--flag=value` options: {"tensor-parallel-size": "8", ...}."""
    return dict(arg[2:].split("=", 1) for arg in recipe["serve"] if arg.startswith("--") and "=" in arg)


def launch_block(recipe: dict) -> str:
    """The page's launch block, line for line."""
    lines = [f"export {k}={v}" for k, v in recipe["env"].items()]
    lines += [f"# Fixes: the {recipe['profile']} profile plus this recipe's opt-in fixes, in the pack's order.",
              "# Stops with a non-zero exit code if the image does not match.",
              recipe["fix-step"]]
    serve = recipe["serve"]
    head = [a for a in serve if not a.startswith("--")]
    flags = _flag_lines([a for a in serve if a.startswith("--")])
    lines.append(" ".join(head) + " \\")
    lines += [f + " \\" for f in flags[:-1]] + flags[-1:]
    return "\n".join(lines)


def docker_run(recipe: dict, image: str = "<port image>", hf_cache: str = "$HOME/.cache/huggingface") -> str:
    """A `docker run` line for one Gaudi node: the port image, every Gaudi card, the recipe's env,
    $COOKBOOK set, and the fix step then the server as the container's command (the entry point is
    bash, so an ENTRYPOINT inherited from the base image does not wrap it)."""
    cookbook = recipe["image"]["cookbook-path"]
    script = recipe["fix-step"].replace(" || exit 1", "") + " && exec " + shlex.join(serve_command(recipe))
    parts = ["docker run --rm -it --runtime=habana -e HABANA_VISIBLE_DEVICES=all",
             "-e OMPI_MCA_btl_vader_single_copy_mechanism=none --cap-add=sys_nice --ipc=host --net=host",
             f"-e COOKBOOK={cookbook}"]
    parts += [f"-e {k}={shlex.quote(str(v))}" for k, v in recipe["env"].items()]
    parts += [f"-v {hf_cache}:/root/.cache/huggingface", f"--entrypoint /bin/bash {image}", "-c " + shlex.quote(script)]
    return " \\\n  ".join(parts)


def cpu_serve_args(recipe: dict) -> list[str]:
    """The CPU variant's api_server flags (`--flag value` argv), without --model/--host/--port."""
    argv = []
    for arg in recipe["cpu-variant"]["serve"]:
        argv += arg.split("=", 1)
    return argv


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m recipes.launch", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["block", "docker", "cpu"])
    parser.add_argument("recipe", nargs="?", default=str(RECIPE))
    parser.add_argument("--image", default="<port image>")
    parser.add_argument("--hf-cache", default="$HOME/.cache/huggingface")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe)
    if args.what == "block":
        print(launch_block(recipe))
    elif args.what == "docker":
        print(docker_run(recipe, args.image, args.hf_cache))
    else:
        print(shlex.join(cpu_serve_args(recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
