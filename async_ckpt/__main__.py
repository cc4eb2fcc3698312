"""``python -m async_ckpt``: the ``async-ckpt`` command."""

import sys

from .cli import main

sys.exit(main())
