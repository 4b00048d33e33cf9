"""The fault simulator: python benchmarks/fault_sim.py --steps N --seed S [--ranks R].
See kvtier/testing/fault_sim.py and tp_sim.py."""

import sys

from kvtier.testing.sim_cli import main

if __name__ == "__main__":
    sys.exit(main())
