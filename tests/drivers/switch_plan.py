"""Train with the command line's plan, switch to the plan in $SWITCH_PLAN after $SWITCH_AT iterations.

Run under torchrun with pretrain_llama.py's flags; used by tests/test_precision_training.py.
"""

import os
import sys

if __name__ == "__main__":
    from megatron_snip.arguments import parse_args
    from megatron_snip.precision.plan import PrecisionPlan
    from megatron_snip.training.logger import setup_console
    from megatron_snip.training.setup import initialize_distributed
    from megatron_snip.training.trainer import Trainer

    args = parse_args(sys.argv[1:])
    setup_console()
    initialize_distributed(args)
    trainer = Trainer(args)
    total = args.train_iters
    args.train_iters = int(os.environ["SWITCH_AT"])
    trainer.train()
    trainer.set_plan(PrecisionPlan.load(os.environ["SWITCH_PLAN"]))
    args.train_iters = total
    trainer.train()
