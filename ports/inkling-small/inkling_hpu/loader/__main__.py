"""`python -m inkling_hpu.loader presplit CHECKPOINT --tp N | verify DIR` (presharded.main)."""
import sys

from inkling_hpu.loader.presharded import main

sys.exit(main())
