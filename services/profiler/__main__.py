"""``python -m services.profiler --engine URL ...`` (the same as ``poise profile``)."""

import sys

from services.profiler.cli import main

sys.exit(main(sys.argv[1:]))
