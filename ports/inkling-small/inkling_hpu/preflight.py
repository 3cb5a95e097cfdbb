"""The port's CPU preflight, run inside a freshly built image (no network, no accelerator), from
the repository the image carries (the cookbook library comes from there):

    cd /opt/gaudi-cookbook && python3 -m inkling_hpu.preflight [--profile P] [--port-profile P] [--model DIR] [--json]

(--profile and --port-profile default to $COOKBOOK_PROFILE and $COOKBOOK_PORT_PROFILE, which install.sh reads too.)

Checks, with the cookbook library the image carries: both commits are the profile's; the port's
runner patches (the conv state in the KV page, the decode window) are in place (a dry run finds
them already applied) and stamped; the KV layout the port declares for the published Inkling-Small
at the page's launch (recipe.yaml) is one full-attention group at block 128 that vLLM's own grouping
accepts, holds the page's pool and gives local layers a 5-block decode window; with --model, every prompt
token id vLLM admits for that checkpoint has an embedding row (the model's start-up guard);
`inkling_hpu` is installed with its vLLM plugin entry point;
vLLM's own plugin loader then resolves the `inkling_py` tool-call and reasoning parsers to the
port's; then the port's CPU tests when the image has torch, pytest and vLLM (a Gaudi image does; the
docker tests' Debian base does not, and says so). The CPU tests run offline against the vLLM and
vllm-gaudi the image has installed (VLLM_SRC, VLLM_GAUDI_SRC); the tests that start a CPU server
(`server`: they need the package index) or compare pristine upstream trees (`pristine`: the image's
are patched) are deselected. Exit 0 when every check passes or is skipped with a reason, 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from cookbook import api, sources, stamp
from cookbook.profiles import DEFAULT_PROFILE, REPO_ROOT

PORT = REPO_ROOT / "ports" / "inkling-small"
PORT_PROFILE = "ports/inkling-small/patches/port.yaml"


def check_commits(profile: str) -> tuple[str, str]:
    results = api.identify(api.load_profile(profile), {})
    bad = [f"{t.name}: expected {t.pin}, found {t.commit} ({t.how})" for t in results if not t.matches]
    if bad:
        return "fail", "; ".join(bad)
    return "pass", ", ".join(f"{t.name} {str(t.commit)[:12]}" for t in results)


def _patched_targets(profile) -> list[str]:
    return sorted({t for name in profile.all_fixes for t in profile.fix(name).targets})


def check_port_patch(port_profile: str) -> tuple[str, str]:
    # Only the targets the port's patches touch (vllm-gaudi): vLLM's identity is the commits row's, judged with
    # the profile whose fixes the container's fix step applied (this series knows none of them).
    profile = api.load_profile(port_profile)
    report = api.run(profile, {}, [], mode="check", only_targets=_patched_targets(profile))
    if not report.ok:
        return "fail", report.error
    not_applied = [f"{f.name}: {f.status}" for f in report.fixes
                   if f.status not in ("already applied", "out of scope")]
    if not_applied:
        return "fail", "not applied: " + ", ".join(not_applied)
    return "pass", ", ".join(f"{f.name} already applied" for f in report.fixes)


def check_stamp(port_profile: str) -> tuple[str, str]:
    profile = api.load_profile(port_profile)
    found = []
    for target in _patched_targets(profile):
        package = profile.targets[target].package
        root = sources.locate(package)
        path = stamp.path(root, package) if root else None
        if not path or not path.exists():
            return "fail", f"{target}: no stamp {path}"
        if profile.name not in stamp.read(path).get("profiles", {}):
            return "fail", f"{path} does not record profile {profile.name}"
        found.append(str(path))
    return "pass", ", ".join(found)


def check_kv_layout() -> tuple[str, str]:
    """Inkling-Small's per-layer KV specs as the glue declares them (block 128, this rank's KV heads,
    the page padded by the conv snapshots), grouped by vLLM's own code, then the start-up guard on
    the page's pool and the decode window the runner patch builds."""
    missing = _not_importable("torch", "vllm")
    if missing:
        return "skip", f"{', '.join(missing)} not importable in this image: KV layout not checked"
    import torch
    from vllm.v1.core.kv_cache_utils import create_kv_cache_group_specs, is_kv_cache_spec_uniform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig

    from inkling_hpu import guards, memory
    from inkling_hpu.model import InklingPortConfig
    from recipes.launch import load_recipe, serve_flags

    flags = serve_flags(load_recipe())
    tp, blocks = int(flags["tensor-parallel-size"]), int(flags["num-gpu-blocks-override"])
    block, max_model_len = int(flags["block-size"]), int(flags["max-model-len"])
    config = InklingPortConfig.from_dict(json.loads((PORT / "configs" / "inkling-small" / "config.json").read_text()))
    per_rank = memory.rank_bytes(config, tp)
    page = (per_rank.kv_per_block + per_rank.conv_per_block) // config.num_hidden_layers   # K/V + snapshots
    specs = {}
    for i in range(config.num_hidden_layers):
        _, kv_heads, head_dim = config.attention_shape(i)
        specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
            block_size=block, num_kv_heads=kv_heads // tp, head_size=head_dim, dtype=torch.bfloat16,
            page_size_padded=page)
    if not is_kv_cache_spec_uniform(specs):
        return "fail", "the layers' KV specs do not merge into one group"
    groups = create_kv_cache_group_specs(specs, [list(specs)])
    line = guards.check_kv_cache_config(KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups),
                                        block, max_model_len, config.num_hidden_layers)
    window = -(-(config.sliding_window_size - 1) // block) + 1
    return "pass", f"{line.removeprefix('Inkling KV cache: ')}; decode window {window} blocks"


def check_token_ids(model: str | None) -> tuple[str, str]:
    """The start-up guard on the served checkpoint (`--model DIR`): every prompt token id vLLM admits (its own
    tokenizer and config readers) has an embedding row."""
    if not model:
        return "skip", "no checkpoint named (--model DIR): token ids not checked"
    missing = _not_importable("torch", "vllm")
    if missing:
        return "skip", f"{', '.join(missing)} not importable in this image: token ids not checked"
    from inkling_hpu import guards, vllm_model

    try:
        return "pass", vllm_model.check_checkpoint_token_ids(model)
    except guards.InklingConfigRefused as refused:
        return "fail", str(refused)


def check_plugin() -> tuple[str, str]:
    try:
        dist = importlib.metadata.distribution("inkling_hpu")
    except importlib.metadata.PackageNotFoundError:
        return "fail", "distribution inkling_hpu is not installed"
    plugins = [ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    if not plugins:
        return "fail", f"inkling_hpu {dist.version} declares no vllm.general_plugins entry point"
    return "pass", f"inkling_hpu {dist.version}: " + ", ".join(f"{ep.name} = {ep.value}" for ep in plugins)


def _not_importable(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def check_parsers() -> tuple[str, str]:
    missing = _not_importable("torch", "vllm")
    if missing:   # vLLM's plugin loader needs torch (the docker tests' base has vLLM's files only)
        return "skip", f"{', '.join(missing)} not importable in this image: parsers not resolved"
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    found = {"tool": ToolParserManager.get_tool_parser("inkling_py"),
             "reasoning": ReasoningParserManager.get_reasoning_parser("inkling_py")}
    wrong = [f"{kind}: {cls.__module__}.{cls.__name__}" for kind, cls in found.items()
             if not cls.__module__.startswith("inkling_hpu.parsers")]
    if wrong:
        return "fail", "inkling_py resolves outside the port: " + ", ".join(wrong)
    return "pass", ", ".join(f"{kind} inkling_py -> {cls.__module__}.{cls.__name__}" for kind, cls in found.items())


def read_stamps(profile: str) -> dict:
    """{target: {path, sha256, stamp}} for every target whose package carries a fix stamp."""
    packages = {t: pin.package for t, pin in api.load_profile(profile).targets.items()}
    found = stamp.installed(list(packages.values()))
    return {t: found[package] for t, package in packages.items() if package in found}


def run_cpu_tests(tests: Path = PORT / "tests" / "cpu") -> tuple[str, str]:
    missing = _not_importable("torch", "pytest", "vllm")
    if missing:
        return "skip", f"{', '.join(missing)} not importable in this image: CPU tests not run"
    if not tests.is_dir():
        return "skip", f"{tests} does not exist"
    installed = {name: importlib.util.find_spec(package) for name, package in
                 (("VLLM_SRC", "vllm"), ("VLLM_GAUDI_SRC", "vllm_gaudi"))}
    # the row reads pytest's own -q tally: options from the caller's PYTEST_ADDOPTS (-v, ...) would change it
    env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
           **{name: str(Path(spec.origin).parents[1]) for name, spec in installed.items() if spec}}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m",
                           "not server and not pristine", str(tests)],
                          capture_output=True, text=True, cwd="/tmp", env=env)
    return ("pass" if proc.returncode == 0 else "fail"), cpu_tests_detail(proc, tests)


def cpu_tests_detail(proc: subprocess.CompletedProcess, tests: Path) -> str:
    """pytest's tally and the tests that failed; when pytest died before its tally (a signal, an internal
    error), why: the signal by name, where it was (the innermost frame in `tests` of Python's fatal-error
    traceback, which pytest's faulthandler prints) and the last lines of its stderr."""
    lines = proc.stdout.strip().splitlines() or [""]
    # pytest's short summary: "FAILED path::test - message"
    failed = [line.split(" ", 1)[1].split(" - ", 1)[0] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    tally = lines[-1].strip("= ") + (f"; failed: {', '.join(failed[:10])}" if failed else "")
    if proc.returncode >= 0 and tally:
        return tally
    if proc.returncode < 0:
        sig = signal.Signals(-proc.returncode)
        how = f"pytest killed by {sig.name} ({signal.strsignal(sig)})"
    else:
        how = f"pytest exited {proc.returncode} before its tally"
    err = [line.strip() for line in proc.stderr.strip().splitlines() if line.strip()]
    frames = [m.groups() for m in (re.match(r'File "(.+)", line (\d+) in (\S+)', line) for line in err) if m]
    inside = [(path, line, func) for path, line, func in frames if Path(path).is_relative_to(tests)]
    if inside:    # most recent call first
        path, line, func = inside[0]
        test = Path(path).relative_to(tests.parent.parent)
        how += f" while {'collecting' if func == '<module>' else 'in'} {test}:{line}" + \
            ("" if func == "<module>" else f" ({func})")
    fatal = next((line for line in err if line.startswith("Fatal Python error")), None)
    tail = [fatal] if fatal else []
    tail += [line for line in err[-3:] if line != fatal]
    return how + ("; stderr: " + " | ".join(tail) if tail else "; stderr empty") + (f"; stdout: {tally}" if tally else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults from the variables install.sh reads: a container started with them (the CPU rehearsal's) is
    # checked against the profiles its image was built with.
    parser.add_argument("--profile", default=os.environ.get("COOKBOOK_PROFILE") or DEFAULT_PROFILE,
                        help="the profile the image was built for (default $COOKBOOK_PROFILE, else " + DEFAULT_PROFILE + ")")
    parser.add_argument("--port-profile", default=os.environ.get("COOKBOOK_PORT_PROFILE") or PORT_PROFILE,
                        help="the port's series (default $COOKBOOK_PORT_PROFILE, else " + PORT_PROFILE + ")")
    parser.add_argument("--model", help="the checkpoint folder the server serves: its token ids are checked")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    port_profile = str(REPO_ROOT / args.port_profile) if args.port_profile.endswith(".yaml") else args.port_profile
    profile = str(REPO_ROOT / args.profile) if args.profile.endswith(".yaml") else args.profile
    checks = []
    for name, func in (("commits", lambda: check_commits(profile)),
                       ("port runner patches", lambda: check_port_patch(port_profile)),
                       ("stamp", lambda: check_stamp(port_profile)),
                       ("KV layout", check_kv_layout),
                       ("token ids", lambda: check_token_ids(args.model)),
                       ("plugin", check_plugin),
                       ("parsers", check_parsers),
                       ("CPU tests", run_cpu_tests)):
        try:
            status, detail = func()
        except Exception as exc:  # a check that crashes is a failed check, reported as such
            status, detail = "fail", f"{type(exc).__name__}: {exc}"
        checks.append({"name": name, "status": status, "detail": detail})
    ok = all(c["status"] != "fail" for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": checks, "stamps": read_stamps(profile)}))
    else:
        for c in checks:
            print(f"{c['status']:<5} {c['name']}: {c['detail']}")
        print("preflight OK" if ok else "preflight FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
