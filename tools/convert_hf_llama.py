#!/usr/bin/env python
"""``python tools/convert_hf_llama.py ...`` = the console command ``megatron-snip-convert-hf-llama ...``
(megatron_snip/cli/convert_hf_llama.py; ``--help`` for its usage)."""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.convert_hf_llama import main

    sys.exit(main())
