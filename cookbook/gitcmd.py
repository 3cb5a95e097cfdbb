"""The one way the library runs git: the command-line tool, with the user's and the system's
configuration kept out (apply.whitespace=fix, say, would silently rewrite lines) and no prompt; and
git's blob id, computed here without running it. Standard library only: the probe runs it inside
bare base images."""
from __future__ import annotations

import hashlib
import os
import subprocess


def blob_id(data: bytes) -> str:
    """git's object id for a blob with these bytes (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def git(*args: str, cwd=None, env: dict | None = None, timeout: int = 300,
        text: bool = True) -> subprocess.CompletedProcess:
    """Run `git ARGS` and return the completed process (the caller reads returncode/stderr);
    never raises for git's own failure."""
    isolated = dict(os.environ, GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull,
                    GIT_TERMINAL_PROMPT="0", **(env or {}))
    return subprocess.run(["git", *args], cwd=cwd, env=isolated, capture_output=True, text=text,
                          timeout=timeout)
