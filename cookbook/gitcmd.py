"""The one way the library runs git: the command-line tool, with the user's and the system's
configuration kept out (apply.whitespace=fix, say, would silently rewrite lines) and no prompt.
Standard library only: the probe runs it inside bare base images."""
from __future__ import annotations

import os
import subprocess


def git(*args: str, cwd=None, env: dict | None = None, timeout: int = 300,
        text: bool = True) -> subprocess.CompletedProcess:
    """Run `git ARGS` and return the completed process (the caller reads returncode/stderr);
    never raises for git's own failure."""
    isolated = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
                    GIT_TERMINAL_PROMPT="0", **(env or {}))
    return subprocess.run(["git", *args], cwd=cwd, env=isolated, capture_output=True, text=text,
                          timeout=timeout)
