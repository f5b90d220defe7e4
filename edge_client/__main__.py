"""``python -m edge_client``: the device entry point (``safl-device``)."""

import sys

from .cli import main

sys.exit(main())
