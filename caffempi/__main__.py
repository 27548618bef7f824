"""``python -m caffempi <command> [flags]``."""
import sys

from .cli import main

sys.exit(main())
