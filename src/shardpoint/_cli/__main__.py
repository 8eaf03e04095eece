"""``python -m shardpoint._cli ...`` runs the ``shardpoint`` command."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
