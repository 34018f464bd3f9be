import sys

from dtorch_sim.cli import main

sys.exit(main())
