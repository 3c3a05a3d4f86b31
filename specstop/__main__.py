"""``python -m specstop COMMAND ...``: the ``specstop`` command, for environments without its entry point."""

import sys

from specstop.cli import main

sys.exit(main())
