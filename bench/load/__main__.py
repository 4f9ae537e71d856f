"""``python -m bench.load``: the ``ferry bench`` command without the ``ferry`` CLI."""

import sys

from bench.load.cli import main

sys.exit(main())
