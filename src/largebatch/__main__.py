"""``python -m largebatch``: the command line (see ``largebatch.cli``)."""

import sys

from largebatch.cli import main

sys.exit(main())
