#!/usr/bin/env python
"""``python tools/snip_solve.py ...`` = the console command ``megatron-snip-solve ...``
(megatron_snip/cli/snip_solve.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.snip_solve import main

    sys.exit(main())
