"""python -m fastqwen serve|chat ...: the `fastqwen` command without the console script installed."""

import sys

from .cli import main

sys.exit(main())
