"""`python -m loongforge.benchmarks NAME` = `loongforge bench NAME`."""

import sys

from loongforge.benchmarks.cli import main

sys.exit(main())
