"""Train with the command line's plan, switch to the plan in $SWITCH_PLAN after $SWITCH_AT iterations.

Run under torchrun with pretrain_llama.py's flags; used by tests/test_precision_training.py.
"""

import os
import sys

if __name__ == "__main__":
    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.precision.plan import PrecisionPlan

    trainer = trainer_from_command_line(sys.argv[1:])
    trainer.train(until=int(os.environ["SWITCH_AT"]))
    trainer.set_plan(PrecisionPlan.load(os.environ["SWITCH_PLAN"]))
    trainer.train()
