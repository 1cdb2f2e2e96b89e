"""``--context-parallel-size`` against the rest of the run: the chunk arithmetic, the attention that
computes it, Megatron-LM's companion flags, and the quantization blocks along tokens."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from megatron_snip.model.config import ALL_GATHER

from .errors import require

if TYPE_CHECKING:
    from megatron_snip.training.config import RunConfig

# --attention-backend values whose local core attention is the SDPA module (model/llama.py's LOCAL_CORE_ATTENTION)
SDPA_BACKENDS = ("auto", "flash", "fused")


def validate_context_parallel(args: argparse.Namespace) -> None:
    """The CP flags against the launch's shape (``args``: the working namespace, layout and architecture
    resolved): one problem per broken rule, a notice for what is accepted and changes nothing here."""
    cp, tp, seq = args.context_parallel_size, args.tensor_model_parallel_size, args.seq_length
    sizes = args.hierarchical_context_parallel_sizes
    require(sizes is None or math.prod(sizes) == cp,
            f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes or ()))}: their product "
            f"{math.prod(sizes or ())} is not --context-parallel-size {cp} (as Megatron-LM requires); drop the flag")
    comm = args.cp_comm_type or ()
    require(len(comm) in (0, 1, args.num_layers),
            f"--cp-comm-type takes one value or one per layer (--num-layers {args.num_layers}), got {len(comm)}")
    if cp == 1:
        return
    require(seq % (2 * cp) == 0,
            f"--seq-length {seq} is not a multiple of 2 x --context-parallel-size {cp} = {2 * cp}: each sequence is "
            f"cut into 2 x CP equal chunks; use a multiple of {2 * cp}")
    require(not args.sequence_parallel or seq % (cp * tp) == 0,
            f"--seq-length {seq} with --sequence-parallel: each CP rank's {seq // cp} tokens are split over "
            f"--tensor-model-parallel-size {tp} ranks; use a multiple of {math.lcm(2 * cp, cp * tp)}")
    require(args.transformer_impl == "local" and args.attention_backend in SDPA_BACKENDS,
            f"--context-parallel-size {cp} runs on the SDPA attention: use --transformer-impl local with "
            f"--attention-backend {'/'.join(SDPA_BACKENDS)} (got --transformer-impl {args.transformer_impl}, "
            f"--attention-backend {args.attention_backend})")
    other = sorted(set(comm) - set(ALL_GATHER))
    if not comm:  # a launch relying on Megatron-LM's default, p2p
        args.notices.append(f"--context-parallel-size {cp} without --cp-comm-type: keys and values are all-gathered "
                            f"over the CP group (all_gather, the one exchange here); Megatron-LM's default is p2p, "
                            f"Transformer Engine's ring attention: the same attention, other communication")
    if other:
        args.notices.append(f"--cp-comm-type {' '.join(other)}: the SDPA attention all-gathers keys and values over "
                            f"the CP group whatever the type (Transformer Engine's ring and all-to-all exchanges are "
                            f"not used here)")


def check_token_blocks(config: RunConfig) -> None:
    """Every precision the run can put on a module must scale whole chunks: a block-scaled format's wgrad
    blocks run along tokens, and each CP rank's chunks must hold whole blocks of the unsplit batch so that a
    CP run quantizes as CP=1 (the TP rule's counterpart, ``recipes.misaligned_split``). Needs the start point
    (its plan and schedule); without one (files not checked) nothing is checked."""
    cp = config.parallel.context_parallel_size
    if cp == 1 or config.start is None:
        return
    from megatron_snip.numerics.recipes import token_block
    from megatron_snip.training.precision_setup import run_precisions

    recipe = config.precision.recipe()
    seq, mbs = config.model.seq_length, config.training.micro_batch_size
    tokens = seq // (2 * cp) * mbs
    for name in run_precisions(config):
        block = token_block(name, recipe)
        require(tokens % block == 0,
                f"{name} with --context-parallel-size {cp}: its wgrad GEMM scales blocks of {block} tokens, but "
                f"each of the 2 x CP chunks of a micro-batch holds {tokens} (--seq-length {seq} / {2 * cp} x "
                f"--micro-batch-size {mbs}); make that a multiple of {block}, or keep {name} out of the plan")
