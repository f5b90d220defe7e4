"""``python -m safl``: the ``safl`` command."""

import sys

from .cli import main

sys.exit(main())
