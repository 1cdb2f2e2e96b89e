#!/usr/bin/env python
"""``python tools/preprocess_data.py ...`` = the console command ``megatron-snip-preprocess-data ...``
(megatron_snip/cli/preprocess_data.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.preprocess_data import main

    sys.exit(main())
