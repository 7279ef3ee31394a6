"""The elastic supervisor (`loongforge train --elastic`): supervisor.py explains it."""
