"""Fix-pack speed: check + apply + verify of a whole profile, side by side with plain `git apply`
of the same patches, on fresh copies of the same trees, in one run (medians of several runs).

    python -m benchmarks.apply_speed [--profile v0.30.0] [--runs 7]      # from the repository root

Targets: vLLM from the pinned v0.30.0 sdist; vllm-gaudi from VLLM_GAUDI_SRC when set. The engine
is timed through its library entry (what apply_all.py calls, without interpreter start-up) and
through the real CLI; the commit pin is not enforced here, so the same patches run on the 091bbadd
vllm-gaudi tree.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cookbook import series, upstream
from cookbook.profiles import DEFAULT_PROFILE, load_profile

REPO = Path(__file__).resolve().parents[1]


def fresh_roots(profile, sources: dict[str, Path], scratch: Path) -> dict[str, Path]:
    roots = {}
    for target, src in sources.items():
        dest = scratch / target
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src / profile.targets[target].package, dest / profile.targets[target].package)
        roots[target] = dest
    return roots


def timed(func) -> float:
    start = time.perf_counter()
    func()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    profile = load_profile(args.profile)
    sources = {"vllm": upstream.vllm_source()}
    if os.environ.get("VLLM_GAUDI_SRC"):
        sources["vllm-gaudi"] = Path(os.environ["VLLM_GAUDI_SRC"])
    fixes = [profile.fix(n) for n in profile.all_fixes]
    names = [f.name for f in fixes if f.available and set(f.targets) <= set(sources)]
    patches = [(p.target, p.path) for f in fixes if f.name in names for p in f.patches]
    skipped = [f.name for f in fixes if f.name not in names]
    print(f"profile {profile.name}: {len(names)} fixes, {len(patches)} patches on {', '.join(sources)}"
          + (f"; left out (no patch yet or target unavailable): {', '.join(skipped)}" if skipped else ""))
    if not patches:
        print("nothing to measure")
        return 0

    measured = profile.only(names)
    scratch = Path(tempfile.mkdtemp(prefix="apply-speed-"))
    engine, cli, plain = [], [], []
    try:
        for _ in range(args.runs):
            roots = fresh_roots(profile, sources, scratch)

            def engine_run():
                for mode in ("check", "apply", "verify"):
                    report = series.run(measured, roots, [], mode=mode, check_pin=False)
                    assert report.ok, report.error

            engine.append(timed(engine_run))

            roots = fresh_roots(profile, sources, scratch)
            if "vllm" in roots:
                vllm_names = [n for n in names if profile.fix(n).targets == ["vllm"]]
                cmd = [sys.executable, str(REPO / "fixes" / "apply_all.py"), "--profile", args.profile,
                       "--target", "vllm", "--vllm-root", str(roots["vllm"])]

                def cli_run():
                    opt = [n for n in vllm_names if n in profile.opt_in]
                    for extra in (["--check"], [], []):
                        subprocess.run(cmd + extra + opt, check=True, capture_output=True)

                cli.append(timed(cli_run) if vllm_names and len(vllm_names) == len(
                    [f for f in fixes if "vllm" in f.targets]) else float("nan"))

            roots = fresh_roots(profile, sources, scratch)

            def plain_run():
                for target, patch in patches:
                    subprocess.run(["git", "apply", str(patch)], cwd=roots[target], check=True)

            plain.append(timed(plain_run))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    med = statistics.median
    print(f"{'what':<52}{'median s':>10}{'min s':>9}")
    print(f"{'engine: check + apply + verify (library)':<52}{med(engine):>10.3f}{min(engine):>9.3f}")
    if cli and not any(x != x for x in cli):
        print(f"{'apply_all.py CLI: --check, apply, re-apply (vLLM only)':<52}{med(cli):>10.3f}{min(cli):>9.3f}")
    print(f"{'plain git apply of the same patches (once)':<52}{med(plain):>10.3f}{min(plain):>9.3f}")
    print(f"ratio engine / plain git apply: {med(engine) / med(plain):.2f}x "
          f"(aim: whole profile under 2 s and under 3x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
