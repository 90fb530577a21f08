"""`python -m sessiongate` is the same as the `sessiongate` console script."""

import sys

from sessiongate.cli import main

sys.exit(main())
