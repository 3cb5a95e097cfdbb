#!/usr/bin/env python3
"""Apply a profile's fixes: `python3 fixes/apply_all.py --profile v0.30.0 [opt-in fixes…]`.

A thin entry point that works from a plain checkout; everything lives in the cookbook library.
Run with --help for the commands and the exit codes."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from cookbook.cli import main
except ImportError as exc:  # the library's few dependencies are missing
    print(f"error: {exc}; install them with: pip install -r "
          f"{Path(__file__).resolve().parents[1] / 'requirements' / 'cookbook.txt'}", file=sys.stderr)
    sys.exit(3)

if __name__ == "__main__":
    main()
