"""`python -m loongforge.benchmarks` = `loongforge bench`."""

import argparse
import logging
import sys

from loongforge.benchmarks.cli import add_arguments, handle

parser = argparse.ArgumentParser(prog="python -m loongforge.benchmarks", description=__doc__)
add_arguments(parser)
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
sys.exit(handle(parser.parse_args()))
