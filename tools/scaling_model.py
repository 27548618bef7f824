#!/usr/bin/env python
"""Predict data-parallel scaling (see caffempi/tools/scaling_model.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from caffempi.tools.scaling_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
