"""`python3 -m builder`: the library's dependencies missing is one line with the command that installs them."""
import sys
from pathlib import Path

try:
    from .cli import main
except ModuleNotFoundError as exc:
    if exc.name not in ("click", "docker", "yaml", "unidiff"):   # not a missing package: a real error
        raise
    requirements = Path(__file__).resolve().parents[1] / "requirements" / "builder.txt"
    print(f"error: {exc}; install them with: pip install -r {requirements}", file=sys.stderr)
    sys.exit(3)

main()
