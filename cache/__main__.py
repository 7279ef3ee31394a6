"""`python -m loongforge.cache serve|stats|stop` (same as `loongforge cache ...`)."""

import sys

from loongforge.cache.cli import main

sys.exit(main())
