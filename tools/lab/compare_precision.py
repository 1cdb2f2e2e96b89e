#!/usr/bin/env python
"""``python tools/lab/compare_precision.py ...`` = the console command ``snip-lab-compare-precision ...``
(snip_lab/cli/compare_precision.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from snip_lab.cli.compare_precision import main

    sys.exit(main())
