"""Write, per rank, how megatron-core names and resolves each linear module of this rank's model chunks.

Run under torchrun with pretrain_llama.py's flags and $PLAN (a plan JSON); builds the trainer, trains
nothing. For every linear module: its path in its chunk's ``GPTModel.named_modules()`` and the precision
megatron-core resolves for that path from the chunk's file of ``megatron_config_files`` (by its own
parser), keyed by the module's global name (``TransformerLayer.layer_number``, through the controller).
Writes $OUT/rank<r>.json; used by tests/test_te_precision_config.py.
"""

import json
import os
import sys
import tempfile

if __name__ == "__main__":
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.models.gpt import GPTModel
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.precision.plan import PrecisionPlan
    from megatron_snip.precision.te_precision_config import megatron_config_files

    trainer = trainer_from_command_line(sys.argv[1:])
    c = trainer.config
    plan = PrecisionPlan.load(os.environ["PLAN"])
    vpp = c.parallel.chunks_per_stage
    files = megatron_config_files(plan, c.precision.recipe(), c.parallel.pipeline_layout(c.model.num_layers))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    global_names = {id(module): name for name, module in trainer.precision.modules().items()}
    out = {}
    for vp, chunk in enumerate(trainer.model):
        model = chunk
        while not isinstance(model, GPTModel):
            model = model.module
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(files[f".pp{stage}" + (f".vp{vp}" if vpp > 1 else "")])
            f.flush()
            recipe = load_quantization_recipe(f.name)
        for path, module in model.named_modules():
            if id(module) in global_names:
                params = TEQuantizationParams.parse_from_config(get_quant_config_or_none(path, recipe))
                te = params.training_recipe
                resolved = te.fp4_quantization_recipe or ("fp8" if te.fp8_quantization_recipe else "bf16")
                out[global_names[id(module)]] = [path, resolved]
    with open(os.path.join(os.environ["OUT"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
