"""Two Ray nodes on this machine for the two-node rehearsal on CPU: a head and a second node on the loopback
addresses of the recipe's CPU variant (`cpu-variant.multi-node`), started with the `ray start` lines that
`python3 -m recipes.launch multi-node --cpu` renders, each with two worker slots (one pipeline stage's TP
pair). Used by tools/cpu_server.py (`--nodes 2`, `make gates NODES=2 TP=2 PP=2`) and the tests.

The nodes' processes inherit the environment given here (a node's Ray workers inherit their raylet's): it
carries the TEST-ONLY Ray device stand-in (tools/ray_standin) on PYTHONPATH. Everything runs under a Ray
session folder of its own, so `stop()` ends this cluster's processes and no other Ray on the machine.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from recipes.launch import cpu_ray_start, load_recipe

REPO = Path(__file__).resolve().parents[1]
STAND_IN = REPO / load_recipe()["cpu-variant"]["multi-node"]["stand-in"]
START_TIMEOUT = 120.0


class RayNodesError(RuntimeError):
    """A Ray node did not start, or the cluster does not show both nodes."""


def _with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process under them (one read of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except (OSError, IndexError, ValueError):
            continue
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = list(pids), list(pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class RayNodes:
    """The two nodes: `start()` returns once Ray lists both alive with their slots, `stop()` kills them."""

    def __init__(self, venv: Path, env: dict, port: int, log: Path):
        self.recipe = load_recipe()
        self.addresses = self.recipe["cpu-variant"]["multi-node"]["addresses"]
        self.venv, self.port, self.log = venv, port, log
        self.address = f"{self.addresses[0]}:{port}"
        self.env = {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"}
        self.temp_dir: str | None = None

    def start(self, timeout: float = START_TIMEOUT) -> "RayNodes":
        # short: Ray's socket paths under it must stay within the 107 bytes of a Unix socket path
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        try:
            for node in range(len(self.addresses)):
                # a session folder per node: Ray's log monitor of a node forwards every worker log under its
                # folder, so a shared one would print each worker's lines twice
                argv = cpu_ray_start(self.recipe, node, self.port, f"{self.temp_dir}/{node}")
                with open(self.log, "a") as log:
                    log.write("$ " + " ".join(argv) + "\n")
                    log.flush()
                    proc = subprocess.run(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
                if proc.returncode != 0:
                    raise RayNodesError(f"`{' '.join(argv[:3])} …` exited {proc.returncode}; log {self.log}:\n"
                                        + self.log.read_text()[-3000:])
            self._wait_for_nodes(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_nodes(self, timeout: float) -> None:
        deadline, nodes = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            nodes = self.nodes()
            if sorted(ip for ip, _ in nodes) == sorted(self.addresses):
                return
            time.sleep(1)
        raise RayNodesError(f"Ray lists nodes {nodes}, expected {self.addresses} alive after {timeout:.0f} s")

    def ray_query(self, code: str):
        """Run `code` (which prints one JSON value) in the server venv's python, connected to this cluster."""
        script = ("import json, ray\nray.init(address=%r, logging_level='ERROR', log_to_driver=False)\n" % self.address
                  + code + "\nray.shutdown()\n")
        proc = subprocess.run([str(self.venv / "bin" / "python"), "-c", script], env=self.env, capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RayNodesError(f"query of Ray at {self.address} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def nodes(self) -> list[tuple[str, float]]:
        """(address, GPU slots) of each alive node, from Ray's node table."""
        return [tuple(n) for n in self.ray_query(
            "print(json.dumps([(n['NodeManagerAddress'], n['Resources'].get('GPU', 0)) for n in ray.nodes() if n['Alive']]))")]

    def actors(self) -> dict[str, str]:
        """Alive actor name -> the address of the node that holds it, from the GCS's actor table (what `ray list
        actors` shows; its state API needs the dashboard, which these nodes do not run)."""
        return self.ray_query(
            "import ray._private.state as state\n"
            "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
            "print(json.dumps({a['Name']: ips.get(a['Address']['NodeID']) for a in state.actors().values()"
            " if a['State'] == 'ALIVE' and a['Name']}))")

    def _raylet(self, address: str) -> int | None:
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                cmd = _cmdline(int(entry.name))
                if "raylet" in cmd.split(" ", 1)[0] and f"--node_ip_address={address}" in cmd and self.temp_dir in cmd:
                    return int(entry.name)
        return None

    def kill_node(self, node: int) -> list[int]:
        """SIGKILL node `node`'s raylet and every process under it (its workers): the node is lost."""
        raylet = self._raylet(self.addresses[node])
        if raylet is None:
            raise RayNodesError(f"no raylet for {self.addresses[node]} under {self.temp_dir}")
        pids = _with_descendants([raylet])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        """End this cluster: every process started under its session folder, and their children."""
        if not self.temp_dir:
            return
        roots = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and self.temp_dir in _cmdline(int(e.name))]
        pids = _with_descendants(roots)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() and _cmdline(p) for p in pids):
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.temp_dir = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
