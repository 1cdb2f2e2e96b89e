"""Core attention through torch's fused ``scaled_dot_product_attention`` (SDPA): the local spec's default.

megatron-core's ``DotProductAttention`` materialises the scores and probabilities of every head,
[b, heads, sq, sk] each, and keeps them for backward: quadratic memory and several passes over
it. :class:`SDPAttention` computes the same function with one call to
``torch.nn.functional.scaled_dot_product_attention``, which on a GPU runs a flash or
memory-efficient kernel (tiles in on-chip memory, nothing quadratic saved) and on a CPU torch's
fused flash kernel. It drops into a layer spec as the ``core_attention`` submodule: megatron-core
0.16.1's constructor and forward signatures, its [s, b, h] layout, its head split over the
tensor-parallel ranks, its softmax scale and its dropout RNG. It has no parameters, so a model's
state dict is the same with either class. What it cannot reproduce it refuses with a ValueError.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide, get_pg_rank, get_pg_size
from torch.nn.attention.bias import causal_lower_right

from megatron_snip.model.context_parallel import ChunkLayout, gather_sequence


def _lower_right(queries: int, keys: int, device: torch.device):
    """The causal mask aligned to the lower right (query i sees keys up to keys - queries + i): torch's
    ``causal_lower_right`` bias (flash attention takes it), or in a graph ``torch.compile`` traces, which
    cannot hold that tensor subclass, the same mask as booleans."""
    if torch.compiler.is_compiling():
        return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return causal_lower_right(queries, keys)

# SDPA's grouped-query attention (kv heads shared by groups of query heads, without copying them)
# came in torch 2.5; the project supports torch >= 2.4, which gets expanded keys and values.
SDPA_HAS_GQA = torch.__version__ >= "2.5"


def _native_gqa(query: torch.Tensor, lower_right: bool, masked: bool) -> bool:
    """Whether SDPA gets the shared kv heads as they are (grouped-query attention inside the kernel) rather
    than expanded to one per query head. With a boolean mask, CUDA's only fused kernel that takes one
    (memory-efficient) has no GQA: torch would fall back to the quadratic math kernel. A lower-right causal
    mask (``causal_lower_right``, context parallelism) runs on CUDA's flash kernel (GQA inside) for fp16 and
    bf16, else on the memory-efficient one (none); on a CPU it is materialised, which any kernel takes."""
    if not SDPA_HAS_GQA or masked:
        return False
    if lower_right:
        return query.device.type != "cuda" or query.dtype in (torch.float16, torch.bfloat16)
    return True


def _refuse_unsupported(config: TransformerConfig, layer_number: int) -> None:
    """ValueError for a configuration whose attention SDPA cannot compute."""
    if config.softmax_type != "vanilla":
        raise ValueError(f"SDPAttention: softmax_type {config.softmax_type!r} (a softmax offset) is not what SDPA "
                         "computes; use --attention-backend unfused (megatron-core's DotProductAttention)")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise ValueError(f"SDPAttention: sliding-window attention (window_size {config.window_size}) is not "
                         "supported; use --attention-backend unfused")


class SDPAttention(MegatronModule):
    """Causal (or masked) multi-head / grouped-query attention of this rank's heads through SDPA.

    Constructor and forward as megatron-core 0.16.1's ``DotProductAttention``. The softmax scale is
    ``softmax_scale`` (``config.softmax_scale``, which megatron's attention passes) or
    1/sqrt(head dim). ``config.apply_query_key_layer_scaling`` changes nothing here: megatron divides
    the scores by the layer number and multiplies them back inside its fp32 softmax (an fp16 range
    guard), the same product SDPA forms in fp32 inside its kernel.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        _refuse_unsupported(config, layer_number)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused, as in DotProductAttention
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        # Context parallelism: this rank's chunks of the sequence; the keys and values of the others are
        # all-gathered whatever cp_comm_type asks (validation says so once, at start-up).
        self.cp_group = getattr(pg_collection, "cp", None)
        self.cp_layout = ChunkLayout(get_pg_size(self.cp_group), get_pg_rank(self.cp_group))
        if self.cp_layout.size != config.context_parallel_size:
            raise ValueError(f"SDPAttention: context_parallel_size {config.context_parallel_size} but a CP group of "
                             f"{self.cp_layout.size} ranks")
        # This rank's heads, as DotProductAttention splits them over the tensor-parallel group.
        world_size = get_pg_size(self.tp_group)
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(config.num_query_groups, world_size)
        head_dim = divide(projection_size, config.num_attention_heads)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.attention_dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """query [sq, b, heads, hn], key and value [sk, b, query groups, hn] (this rank's) -> [sq, b, heads * hn].

        ``attention_mask``: None (the constructor's mask type decides: causal, or none), or megatron's
        boolean mask, True where a query must not see a key, broadcastable to [b, heads, sq, sk] (what
        ``--reset-attention-mask`` produces). As in DotProductAttention, a given mask is used as it is
        and the forward's ``attn_mask_type`` is not read. One difference: a query row whose keys are
        all masked (only padding masks make one) gives 0 here and the mean of the values there.

        Under context parallelism the rows are this CP rank's two chunks of the sequence (sq = sk =
        S / CP) and a mask has this rank's query rows over all S keys, [b, 1, S / CP, S] (what
        megatron-core's ``get_batch_on_this_cp_rank`` makes of the data loader's): see
        ``model/context_parallel.py``.
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention bias are not supported "
                             "(DotProductAttention has neither); use --transformer-impl transformer_engine")
        sq, sk = query.size(0), key.size(0)
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4):
            raise ValueError(f"SDPAttention: the attention mask must be megatron's boolean [b, 1, sq, sk] "
                             f"(True = masked), got {attention_mask.dtype} of shape {tuple(attention_mask.shape)}")
        causal = self._causal(attention_mask, sq)
        if self.cp_layout.size > 1:
            if attention_mask is None and not causal:
                raise ValueError("SDPAttention: under context parallelism attention is causal (or given a mask); "
                                 f"got mask type {self.attn_mask_type.name} without a mask")
            key, value = (gather_sequence(t, self.cp_group, self.cp_layout) for t in (key, value))
        elif causal and sq != sk:
            raise ValueError(f"SDPAttention: causal attention without a mask needs as many queries as keys, "
                             f"got {sq} and {sk}")
        return self.attend(query, key, value, attention_mask, self.cp_layout)

    def _causal(self, attention_mask: torch.Tensor | None, sq: int) -> bool:
        """Whether the constructor's causal mask applies (no mask given, more than one query)."""
        return attention_mask is None and self.attn_mask_type == AttnMaskType.causal and sq > 1

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, layout: ChunkLayout) -> torch.Tensor:
        """The attention of ``query`` [sq, b, heads, hn] over ``key`` and ``value`` [sk, b, groups, hn]
        -> [sq, b, heads * hn]. With a CP ``layout`` (size > 1) the queries are that rank's two chunks
        and the keys and values the whole sequence, in order (what :meth:`forward` gathered): one SDPA call
        per query chunk over the keys up to its end."""
        sq, b = query.size(0), query.size(1)
        causal = self._causal(attention_mask, sq)
        # [s, b, n, hn] -> [b, n, s, hn] (views; every kernel takes the strides)
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        allowed = None if attention_mask is None else ~attention_mask  # SDPA's boolean mask: pairs that take part
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1 and not _native_gqa(query, lower_right=causal and layout.size > 1, masked=allowed is not None):
            key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))  # once, before any chunking
        gqa = {"enable_gqa": True} if key.size(1) != query.size(1) else {}
        dropout_p = self.attention_dropout_p if self.training else 0.0
        # As DotProductAttention: each TP rank holds other heads, so it draws its dropout from the RNG
        # tracker's per-rank stream; under sequence parallelism the whole block already runs in that fork.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else nullcontext():
            if layout.size == 1:
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout_p,
                                                         is_causal=causal, scale=self.softmax_scale, **gqa)
            else:  # lower-right causal: chunk k's query i sees the keys up to k·c + i
                context = torch.cat([F.scaled_dot_product_attention(
                    query[:, :, rows], key[:, :, :keys], value[:, :, :keys],
                    attn_mask=_lower_right(rows.stop - rows.start, keys, query.device) if causal
                    else allowed[..., rows, :keys],
                    dropout_p=dropout_p, scale=self.softmax_scale, **gqa)
                    for rows, keys in layout.query_chunks(sq)], dim=2)
        # [b, heads, sq, hn] -> [sq, b, heads * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
