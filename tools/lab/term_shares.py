#!/usr/bin/env python
"""``python tools/lab/term_shares.py ...`` = the console command ``snip-lab-term-shares ...``
(snip_lab/cli/term_shares.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from snip_lab.cli.term_shares import main

    sys.exit(main())
