"""``python -m largebatch``: the command line (see ``largebatch.recipes.cli``)."""

import sys

from largebatch.recipes.cli import main

sys.exit(main())
