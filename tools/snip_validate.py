#!/usr/bin/env python
"""``python tools/snip_validate.py ...`` = the console command ``megatron-snip-validate ...``
(megatron_snip/cli/snip_validate.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.snip_validate import main

    sys.exit(main())
