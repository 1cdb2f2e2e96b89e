#!/usr/bin/env python
"""Pretrain a Llama-family model with megatron-core: launch with torchrun or srun.

    torchrun --nproc-per-node 4 pretrain_llama.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --data-path DATA_text_document \
        --tokenizer-model TOK.model --train-iters 200 ...

Flags: python pretrain_llama.py --help, or docs/flags.md.
"""

import sys

# Entry scripts need this guard: dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    from megatron_snip.cli.pretrain import main  # light: megatron-core is imported once the flags parse

    sys.exit(main())
