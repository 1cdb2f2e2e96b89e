"""Logits of the model in --load (e.g. an imported Hugging Face Llama) on fixed tokens.

Run under torchrun with pretrain_llama.py's flags (any TP x PP layout); $LOGITS_TOKENS is a
torch file of token ids (micro-batch-size x seq-length); the full-vocabulary fp32 logits are
written to $LOGITS_OUT by the rank that holds them. Used by tests/test_hf_interop.py.
"""

import os
import sys

if __name__ == "__main__":
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_snip.cli.pretrain import trainer_from_command_line

    trainer = trainer_from_command_line(sys.argv[1:])
    trainer.resume()
    tokens = torch.load(os.environ["LOGITS_TOKENS"])
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)
        return output, lambda out: (out.sum() * 0, {"logits": gather_from_tensor_model_parallel_region(out)})

    for chunk in trainer.model:
        chunk.eval()
    with torch.no_grad():
        out = trainer.forward_backward(forward_step_func=forward_step, data_iterator=iter([None]),
                                       model=trainer.model, num_microbatches=1, seq_length=tokens.shape[1],
                                       micro_batch_size=tokens.shape[0], forward_only=True)
    if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save(out[0]["logits"].float(), os.environ["LOGITS_OUT"])
    dist.barrier()
