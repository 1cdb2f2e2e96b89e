"""Context parallelism (CP) for the SDPA core attention: the sequence split over the CP group, keys and
values all-gathered, each query chunk attending to the keys before it. Exact: no log-sum-exp merging.

megatron-core splits every micro-batch's sequence of S tokens into 2·CP chunks of c = S / (2·CP) tokens
(``utils.get_batch_on_this_cp_rank``, which the caller applies to the batch) and CP rank r keeps chunks r
and 2·CP-1-r, in that order: an early and a late chunk, so that every rank does the same share of causal
attention's work. RoPE, the norms, the MLP and the linears need nothing more (each token is on one rank);
attention needs the keys and values of every earlier token. As Llama 3's training does, each rank
all-gathers K and V over the CP group (:func:`gather_sequence`; its backward reduce-scatters dK and dV,
summing every rank's queries' contributions), puts the chunks back in sequence order, and runs one
attention call per local query chunk k over the keys [0, (k+1)·c) with a causal mask aligned to the lower
right (query i of the chunk sees keys up to k·c + i). With grouped-query attention K and V are small next
to Q (8 kv heads for 64 query heads in Llama 3 70B), which is what makes gathering them cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_snip.model import graph_collectives


@dataclass(frozen=True)
class ChunkLayout:
    """Which chunks of the sequence a CP rank holds (megatron-core's load balance for causal attention).

    Attributes:
        size: CP ranks; the sequence is cut into 2·size chunks.
        rank: this rank in the CP group; it holds chunks ``rank`` and ``2·size-1-rank``.
    """

    size: int
    rank: int

    @property
    def chunks(self) -> tuple[int, int]:
        """The sequence chunks this rank holds, in the order its tensors hold them."""
        return self.rank, 2 * self.size - 1 - self.rank

    def sequence_order(self) -> list[int]:
        """For each chunk of the sequence in order, its place among the 2·size chunks of an all-gather over
        the CP group (rank q's two chunks at places 2q and 2q+1)."""
        place = {}
        for q in range(self.size):
            first, second = ChunkLayout(self.size, q).chunks
            place[first], place[second] = 2 * q, 2 * q + 1
        return [place[k] for k in range(2 * self.size)]

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's two chunks of ``t``, the whole sequence along dim 0: [2c, ...] from [2·size·c, ...]
        (what megatron-core's ``get_batch_on_this_cp_rank`` keeps, for sequence-first tensors)."""
        c = t.shape[0] // (2 * self.size)
        return torch.cat([t[k * c:(k + 1) * c] for k in self.chunks])

    def query_chunks(self, local_length: int) -> list[tuple[slice, int]]:
        """For each of this rank's two query chunks: its rows among the ``local_length`` (= 2·c) local
        positions and the number of keys it attends to under a causal mask, (k+1)·c for chunk k."""
        c = local_length // 2
        return [(slice(i * c, (i + 1) * c), (k + 1) * c) for i, k in enumerate(self.chunks)]


def gather_sequence(t: torch.Tensor, group: torch.distributed.ProcessGroup, layout: ChunkLayout) -> torch.Tensor:
    """This rank's [2c, ...] (its two chunks, sequence first) -> the whole sequence [2·size·c, ...] in order.

    Forward: an all-gather over ``group`` (megatron-core's sequence-parallel gather, on any backend);
    backward: the gradient's chunks put back in gather order and reduce-scattered, so this rank's part
    of dK / dV sums what every rank's queries contributed."""
    gather = (graph_collectives.gather_from_sequence_parallel_region if torch.compiler.is_compiling()
              else gather_from_sequence_parallel_region)  # a compiled layer: the functional all-gather
    gathered = gather(t, tensor_parallel_output_grad=True, group=group)
    chunks = gathered.view(2 * layout.size, t.shape[0] // 2, *t.shape[1:])
    order = torch.tensor(layout.sequence_order(), device=t.device)
    return chunks.index_select(0, order).view(-1, *t.shape[1:])
