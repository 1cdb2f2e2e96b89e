#!/usr/bin/env python
"""``python tools/train_tokenizer.py ...`` = the console command ``megatron-snip-train-tokenizer ...``
(megatron_snip/cli/train_tokenizer.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.train_tokenizer import main

    sys.exit(main())
