"""Run vLLM's real HTTP launcher (`serve_http`: uvicorn, its engine watchdog, its signal handling) on a
FastAPI app until it stops, and exit as the API server process would.

    python serve.py {engine-dies|sigterm} PORT

engine-dies: one second in, the engine client reports a dead engine (errored, not running), as vLLM's
AsyncLLM does once its EngineCore died; the launcher's watchdog then stops the server.
sigterm: one second in, the process gets SIGTERM (an operator's `docker stop`), the engine alive.
Run with the vLLM tree under test on PYTHONPATH.
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys

from fastapi import FastAPI

from vllm.entrypoints.launchers.launcher import serve_http


class EngineClientStandIn:
    """STAND-IN for vLLM's engine client (a real engine cannot run from the unbuilt sdist): the
    attributes the launcher reads. Running until `die()`, then errored and not running, as AsyncLLM
    reports an EngineCore that died."""

    errored = False
    is_running = True

    class vllm_config:  # noqa: N801 - the attribute the launcher reads on shutdown
        shutdown_timeout = 0

    def die(self) -> None:
        self.errored, self.is_running = True, False

    def shutdown(self, timeout=None) -> None:
        pass


async def main(scenario: str, port: int) -> None:
    app = FastAPI()
    engine = EngineClientStandIn()
    app.state.engine_client = engine
    loop = asyncio.get_running_loop()
    if scenario == "engine-dies":
        loop.call_later(1.0, engine.die)
    else:
        loop.call_later(1.0, os.kill, os.getpid(), signal.SIGTERM)
    shutdown = await serve_http(app, sock=None, host="127.0.0.1", port=port, log_level="warning")
    await shutdown


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("engine-dies", "sigterm"):
        sys.exit(f"usage: serve.py {{engine-dies|sigterm}} PORT; got {sys.argv[1:]}")
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
