"""pretrain_llama.py with a non-finite gradient injected: a test-only fault, not a production flag.

Run under torchrun with pretrain_llama.py's flags; used by tests/test_numerical_safety.py.
Environment:
    INJECT_AT        the iteration (1-based, as logged) whose backward pass is corrupted
    INJECT_PARAM     global parameter name, e.g. decoder.layers.3.mlp.linear_fc2.weight: one element of its
                     gradient is corrupted; or
    INJECT_INPUT     global linear module name, e.g. decoder.layers.1.mlp.linear_fc2: one element of its input
                     is corrupted in the forward pass; or
    INJECT_OUTPUT    global linear module name: one element of its output is corrupted in the forward pass
                     (after the module: its consumer sees a non-finite input); or
    INJECT_GEMM      global linear module name: one element of its quantized forward GEMM's result is corrupted
                     (as an overflowing GEMM would make it from finite operands)
    INJECT_TP_RANK   only this tensor-parallel rank's shard is corrupted (default: every shard)
    INJECT_VALUE     nan (default) or inf, the value written
    PARAM_DIGESTS    optional directory: rank{R}.json maps each iteration to a SHA-256 of this rank's
                     weights entering it
"""

import hashlib
import json
import os
import sys


def instrument(trainer) -> None:
    import torch
    from megatron.core import parallel_state

    from megatron_snip.model.parameter_names import global_parameter_names

    at = int(os.environ["INJECT_AT"])
    tp_rank = os.environ.get("INJECT_TP_RANK")
    value = float(os.environ.get("INJECT_VALUE", "nan"))
    here = tp_rank is None or int(tp_rank) == parallel_state.get_tensor_model_parallel_rank()

    def corrupt(t):
        if trainer.state.iteration + 1 != at:
            return t
        t = t.clone()
        t[(0,) * t.dim()] = value
        return t

    params = {name: p for p, name in global_parameter_names([trainer.model[0].module]).items()}
    if os.environ.get("INJECT_PARAM") in params and here:
        params[os.environ["INJECT_PARAM"]].register_hook(corrupt)
    modules = trainer.precision.modules()
    if os.environ.get("INJECT_INPUT") in modules and here:
        modules[os.environ["INJECT_INPUT"]].register_forward_pre_hook(lambda m, args: (corrupt(args[0]), *args[1:]))
    if os.environ.get("INJECT_OUTPUT") in modules and here:  # (output, bias)
        modules[os.environ["INJECT_OUTPUT"]].register_forward_hook(lambda m, args, out: (corrupt(out[0]), *out[1:]))

    if os.environ.get("INJECT_GEMM") in modules and here:
        from megatron_snip.numerics import linear

        target, matmul, inside = modules[os.environ["INJECT_GEMM"]], linear._matmul, []
        target.register_forward_pre_hook(lambda m, args: inside.append(True))
        target.register_forward_hook(lambda m, args, out: inside.clear())
        # Only the forward GEMM runs inside the module's forward; the backward GEMMs run later.
        linear._matmul = lambda *args: corrupt(matmul(*args)) if inside else matmul(*args)

    out = os.environ.get("PARAM_DIGESTS")
    if out:
        digests, step = {}, trainer.train_step
        path = os.path.join(out, f"rank{torch.distributed.get_rank()}.json")

        def digested_step(data):
            h = hashlib.sha256()
            for p in trainer.model[0].module.parameters():
                h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digests[trainer.state.iteration + 1] = h.hexdigest()
            with open(path, "w") as f:
                json.dump(digests, f)
            return step(data)

        trainer.train_step = digested_step


if __name__ == "__main__":
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    from megatron_snip.cli.pretrain import main

    sys.exit(main(on_build=instrument))
