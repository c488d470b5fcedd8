"""``python -m experiments.tables [--check]``: :func:`experiments.tables.regenerate.main`."""

from __future__ import annotations

import sys

from experiments.tables.regenerate import main


if __name__ == "__main__":
    sys.exit(main())
