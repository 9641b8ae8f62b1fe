"""``python -m kvtier``: the ``kvtier`` command (kvtier/tools/cli.py)."""

from kvtier.tools.cli import main

raise SystemExit(main())
