"""`troupe compress` run from a checkout: `python apps/compress.py [--config RECIPE] [key=value ...]`
(see `python apps/compress.py --help`, or troupe/pretrain/compress.py)."""

import sys
from pathlib import Path

# the troupe next to this script comes first: `ray job submit --working-dir .` runs the code
# you uploaded, whether or not (and whichever) troupe is installed on the cluster
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from troupe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["compress", *sys.argv[1:]]))
