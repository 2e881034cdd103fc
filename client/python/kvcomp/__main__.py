"""python -m kvcomp: the command line (see kvcomp.cli)."""

import sys

from .cli import main

sys.exit(main())
