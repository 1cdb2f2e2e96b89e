#!/usr/bin/env python
"""``python tools/merge_comparisons.py ...`` = the console command ``megatron-snip-merge-comparisons ...``
(megatron_snip/cli/merge_comparisons.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.merge_comparisons import main

    sys.exit(main())
