#!/usr/bin/env python
"""``python tools/lab/merge_comparisons.py ...`` = the console command ``snip-lab-merge-comparisons ...``
(snip_lab/cli/merge_comparisons.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from snip_lab.cli.merge_comparisons import main

    sys.exit(main())
