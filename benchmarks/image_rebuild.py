#!/usr/bin/env python3
"""Port image build times: cold vs nothing changed vs one fix edited, measured in one run.

    python3 -m benchmarks.image_rebuild [--rounds 3] [--base IMAGE]      # from the repository root

Builds ports/inkling-small/Dockerfile with the builder (`python3 -m builder build`, what
`make image` runs; no preflight) from a copy of this repository, so the edit never touches the
working tree. Each round: a cold build (--no-cache), a rebuild with nothing changed, and a
rebuild after editing one fix's metadata. Prints the median of each, the ratios to the cold
build, and the size of the layers the port adds to the base. Aims: no-change rebuild under 10% of
the cold build; port layers under 50 MB.

Without --base it makes the docker tests' stock-layout base (tools/stand_in_bases.py: needs
a running Docker engine, and VLLM_GAUDI_SRC or VLLM_GAUDI_MIRROR for the runner patch to apply).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TEST_PROFILE = "tests/builder/profiles/test-base.yaml"
TEST_PORT_PROFILE = "tests/builder/profiles/port-test-base.yaml"
EDITED_FIX = "fixes/prompt-order/fix.yaml"


def copy_repo(dest: Path) -> Path:
    """The files git knows about (tracked and untracked, not ignored), as they are now."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "-co", "--exclude-standard"],
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def build(repo: Path, base: str, tag: str, *extra: str) -> tuple[float, dict]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "builder", "build", "--base", base, "--tag", tag,
                           "--profile", TEST_PROFILE, "--port-profile", TEST_PORT_PROFILE,
                           "--no-preflight", "--json", *extra],
                          cwd=repo, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"build failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return seconds, json.loads(proc.stdout)


def port_layers(client, image: str, base: str) -> list[tuple[str, int]]:
    """(instruction, bytes) for each layer the port adds on top of the base."""
    base_ids = {h["Id"] for h in client.api.history(base)}
    layers = []
    for entry in client.api.history(image):
        if entry["Id"] in base_ids:
            break
        if entry["Size"]:
            layers.append((entry["CreatedBy"].replace("/bin/sh -c ", "")[:70], entry["Size"]))
    return layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", help="a base image that matches tests/builder/profiles/test-base.yaml")
    args = parser.parse_args()

    import docker

    client = docker.from_env(timeout=1800)
    base = args.base
    if not base:
        from tools import stand_in_bases

        base = stand_in_bases.stock_layout_base(client)
    tag = "gaudi-cookbook-bench/inkling-small:latest"
    times = {"cold": [], "unchanged": [], "one fix edited": []}
    with tempfile.TemporaryDirectory(prefix="cookbook-bench-") as tmp:
        repo = copy_repo(Path(tmp))
        for round_no in range(1, args.rounds + 1):
            seconds, cold = build(repo, base, tag, "--no-cache")
            times["cold"].append(seconds)
            seconds, same = build(repo, base, tag)
            times["unchanged"].append(seconds)
            if same["cached_steps"] != same["cacheable_steps"]:
                print(f"round {round_no}: the unchanged rebuild missed the cache "
                      f"({same['cached_steps']}/{same['cacheable_steps']} steps cached)")
            with open(repo / EDITED_FIX, "a") as fh:
                fh.write(f"# benchmark edit {round_no} {time.time()}\n")
            seconds, _edited = build(repo, base, tag)
            times["one fix edited"].append(seconds)
            print(f"round {round_no}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in times.items()),
                  flush=True)
        layers = port_layers(client, cold["image_id"], base)

    cold_median = statistics.median(times["cold"])
    print(f"\nport image on {base}, {args.rounds} rounds (medians, whole `builder build` wall time)")
    print(f"{'build':<16}{'median s':>10}{'min s':>8}{'max s':>8}{'vs cold':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<16}{median:>10.1f}{min(values):>8.1f}{max(values):>8.1f}"
              f"{median / cold_median:>8.1%}")
    total = sum(size for _, size in layers)
    print(f"\nport layers: {total / 1e6:.1f} MB")
    for instruction, size in layers:
        print(f"  {size / 1e6:8.2f} MB  {instruction}")
    ratio = statistics.median(times["unchanged"]) / cold_median
    print(f"\naim: unchanged rebuild < 10% of cold: {'met' if ratio < 0.10 else 'NOT met'} ({ratio:.1%}); "
          f"port layers < 50 MB: {'met' if total < 50e6 else 'NOT met'} ({total / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
