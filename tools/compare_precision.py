#!/usr/bin/env python
"""``python tools/compare_precision.py ...`` = the console command ``megatron-snip-compare-precision ...``
(megatron_snip/cli/compare_precision.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.compare_precision import main

    sys.exit(main())
