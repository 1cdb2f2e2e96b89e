#!/usr/bin/env python
"""``python tools/lab/snip_validate.py ...`` = the console command ``snip-lab-validate ...``
(snip_lab/cli/snip_validate.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from snip_lab.cli.snip_validate import main

    sys.exit(main())
