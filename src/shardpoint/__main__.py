"""``python -m shardpoint ...`` runs the ``shardpoint`` command (for an environment whose
scripts directory is not on ``PATH``)."""

from __future__ import annotations

import sys

from ._cli.main import main

if __name__ == "__main__":  # imported (autodoc, pkgutil walks): nothing runs
    sys.exit(main())
