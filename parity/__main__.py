"""``python -m parity VERB ...``: the ``parity`` command (``torchrun ... -m parity VERB`` under a launcher)."""

import sys

from harness.cli import main

sys.exit(main())
