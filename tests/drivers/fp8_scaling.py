"""Train with pretrain_llama.py's flags, then print how each FP8 GEMM operand was scaled (one JSON line).

Run under torchrun; used by tests/test_megatron_compat.py. Prints on every rank, after training:
``FP8-SCALING {"module": {"x": [history length, algorithm], ...}, ...}``: the delayed-scaling histories
the modules' GEMMs kept ({} per module: scaled by their current amax, no history).
"""

import json
import sys

if __name__ == "__main__":
    from megatron_snip.cli.pretrain import trainer_from_command_line

    trainer = trainer_from_command_line(sys.argv[1:])
    trainer.train()
    kept = {name: {op: [s.amax_history.numel(), s.algo] for op, s in state["delayed"].items()}
            for name, state in trainer.precision.quant_states().items()}
    print("FP8-SCALING " + json.dumps(kept), flush=True)
