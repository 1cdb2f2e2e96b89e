#!/usr/bin/env python
"""``python tools/build_corpus.py ...`` = the console command ``megatron-snip-build-corpus ...``
(megatron_snip/cli/build_corpus.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.build_corpus import main

    sys.exit(main())
