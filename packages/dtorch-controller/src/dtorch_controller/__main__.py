"""`python -m dtorch_controller` is the `dtorch-controller` console script."""

import sys

from dtorch_controller.cli import main

sys.exit(main())
