"""``python -m rlhfc.cli``."""

import sys

from rlhfc.cli import main

sys.exit(main())
