import sys

from kvtier.pool.cli import main

sys.exit(main())
