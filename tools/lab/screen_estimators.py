#!/usr/bin/env python
"""``python tools/lab/screen_estimators.py ...`` = the console command ``snip-lab-screen-estimators ...``
(snip_lab/cli/screen_estimators.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from snip_lab.cli.screen_estimators import main

    sys.exit(main())
