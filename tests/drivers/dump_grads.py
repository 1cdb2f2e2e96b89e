"""Train --train-iters steps, then run one more forward-backward (no optimizer step) and save every
parameter's reduced gradient, unsharded and named independently of the layout, to $GRADS_OUT.

Run under torchrun with pretrain_llama.py's flags (not with the distributed optimizer, whose
gradient buffers hold only this rank's shard after the reduce-scatter); used by
tests/test_parallel.py to compare gradients between layouts, not only losses.
"""

import os
import sys

if __name__ == "__main__":
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.model.parameter_names import global_parameter_names
    from megatron_snip.snip.noise import param_global_index

    trainer = trainer_from_command_line(sys.argv[1:])
    if trainer.config.checkpoint.load:
        trainer.resume()
    trainer.train()
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer._run(trainer.batches("train", trainer.state.consumed_samples), forward_only=False)
    grads = {}
    for param, name in global_parameter_names(trainer.model).items():
        # Scatter this rank's shard into the full tensor; the TP sum completes it (replicas: rank 0's).
        full = torch.zeros(param.numel() * (parallel_state.get_tensor_model_parallel_world_size()
                                            if getattr(param, "tensor_model_parallel", False) else 1))
        if getattr(param, "tensor_model_parallel", False) or parallel_state.get_tensor_model_parallel_rank() == 0:
            full[param_global_index(param)] = param.main_grad.detach().float().view(-1).cpu()
        dist.all_reduce(full, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = full
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, grads if parallel_state.get_data_parallel_rank() == 0 else {})
    if dist.get_rank() == 0:
        torch.save({k: v for part in parts for k, v in part.items()}, os.environ["GRADS_OUT"])
    dist.barrier()
