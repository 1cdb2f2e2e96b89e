#!/usr/bin/env python
"""``python tools/lab/compare_layouts.py ...`` = the console command ``snip-lab-compare-layouts ...``
(snip_lab/cli/compare_layouts.py; ``--help`` for its usage)."""

import sys

if __name__ == "__main__":
    from snip_lab.cli.compare_layouts import main

    sys.exit(main())
