"""``python -m troupe rlhf|pretrain|serve ...``: the ``troupe`` command (troupe.cli)."""

import sys

from troupe.cli import main

sys.exit(main())
