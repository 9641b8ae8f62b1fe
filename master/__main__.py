"""``python -m kvtier.master`` is ``kvtier-master``."""

import sys

from kvtier.master.cli import main

sys.exit(main())
