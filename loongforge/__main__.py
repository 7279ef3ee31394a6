import sys

from loongforge.cli import main

sys.exit(main())
