"""`python -m minicb.bench`, the same as `python -m minicb bench` (see cli.py)."""
import sys

from minicb.bench.cli import main

sys.exit(main())
