"""Where things are: the checkout (``REPO``, what a worker process needs on ``sys.path``) and the
worker scripts started by path (``WORKERS``, tests/workers/)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = os.path.join(REPO, "tests", "workers")
