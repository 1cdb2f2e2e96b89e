"""--context-parallel-size: the SDPA attention over a CP group (megatron_snip/model/context_parallel.py)
against full causal attention, and the chunk layout against megatron-core's.

Four spawned gloo processes run the attention module at CP=4, then at CP=2 (x DP2), in fp64: the
output and the query, key and value gradients of every rank's chunks equal a plain softmax reference
computed on the whole sequence, with grouped-query attention, causal and under a
--reset-attention-mask mask; under megatron-core's selective recompute (its checkpoint of the core
attention) the gathered keys and values are not kept for backward and the gradients stay exact.
The training-level parity runs are in tests/test_parallel.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, run_config

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 32, 2, 4, 2, 8  # GQA: 2 query heads per kv head
EXACT = 1e-12  # fp64; a prototype matched to ~2e-15


def test_chunk_layout_is_megatrons():
    """Rank r holds chunks r and 2CP-1-r (megatron-core's get_batch_on_this_cp_rank), and the all-gather's
    places map back to the sequence's order."""
    from megatron_snip.model.context_parallel import ChunkLayout

    assert [ChunkLayout(4, r).chunks for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # gathered places: rank 0 -> chunks 0, 7; rank 1 -> 1, 6; ...
    gathered = [k for r in range(4) for k in ChunkLayout(4, r).chunks]
    assert [gathered[p] for p in ChunkLayout(4, 1).sequence_order()] == list(range(8))
    assert ChunkLayout(2, 1).query_chunks(8) == [(slice(0, 4), 8), (slice(4, 8), 12)]


# ----------------------------------------------------------------------------------------------
# Unit tier: the flags, their refusals, the quantization blocks along tokens


def _problems(*flags: str, world: int = 2) -> list[str]:
    from megatron_snip.arguments import ArgumentError

    try:
        run_config(*flags, world_size=world)
    except ArgumentError as e:
        return e.problems
    return []


GQA4 = ("--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4")


@pytest.mark.parametrize("flags,world,message", [
    ((), 3, "world size 3 is not divisible by --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 "
            "x --context-parallel-size 2 = 2; launch a multiple of 2"),
    (("--seq-length", "66", "--max-position-embeddings", "66"), 2,
     "--seq-length 66 is not a multiple of 2 x --context-parallel-size 2 = 4: each sequence is cut into 2 x CP equal"),
    ((*GQA4, "--tensor-model-parallel-size", "4", "--sequence-parallel", "--seq-length", "68",
      "--max-position-embeddings", "68"), 8, "--seq-length 68 with --sequence-parallel: each CP rank's 34 tokens are "
                                             "split over --tensor-model-parallel-size 4 ranks; use a multiple of 8"),
    (("--attention-backend", "unfused"), 2, "--context-parallel-size 2 runs on the SDPA attention: use "
                                            "--transformer-impl local with --attention-backend auto/flash/fused"),
    (("--hierarchical-context-parallel-sizes", "4"), 2, "--hierarchical-context-parallel-sizes 4: their product 4 "
                                                       "is not --context-parallel-size 2"),
    (("--cp-comm-type", "p2p", "a2a", "p2p"), 2, "--cp-comm-type takes one value or one per layer (--num-layers 4), "
                                                "got 3"),
], ids=["world", "seq-length", "seq-parallel", "backend", "hierarchical", "comm-per-layer"])
def test_context_parallel_refusals(flags, world, message):
    problems = _problems("--context-parallel-size", "2", *flags, world=world)
    assert len(problems) == 1 and problems[0].startswith(message), problems


def test_context_parallel_layout_and_comm_types():
    """DP is what TP x PP x CP leaves; Megatron-LM's ring and all-to-all types are accepted with one notice."""
    run = run_config("--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--cp-comm-type", "p2p", world_size=8)
    assert (run.parallel.context_parallel_size, run.parallel.data_parallel_size) == (2, 2)
    assert run.training.num_microbatches == 1  # the global batch (8 / mbs 2) over DP 2, not over DP x CP
    notices = [n for n in run.logging.notices if "--cp-comm-type" in n]
    assert notices == ["--cp-comm-type p2p: the SDPA attention all-gathers keys and values over the CP group "
                       "whatever the type (Transformer Engine's ring and all-to-all exchanges are not used here)"]
    quiet = run_config("--context-parallel-size", "2", "--cp-comm-type", "all_gather", world_size=2)
    assert not [n for n in quiet.logging.notices if "--cp-comm-type" in n]


def test_token_blocks_must_not_straddle_context_parallel_ranks(tiny_data):
    """nvfp4's wgrad blocks are 16 tokens, mxfp4's 32: a chunk of 64 / 4 tokens x 2 samples holds 32."""
    from conftest import train_args

    from megatron_snip.arguments import ArgumentError, parse_config
    from megatron_snip.numerics.recipes import RecipeConfig, token_block

    names = ("bf16", "fp8", "fp8:rowwise", "nvfp4", "mxfp4", "fp8:mxfp8")
    assert [token_block(n) for n in names] == [1, 1, 1, 16, 32, 32]
    assert token_block("fp8", RecipeConfig(fp8_recipe="blockwise")) == 128
    parse_config(train_args(tiny_data, "--context-parallel-size", "2", "--precision", "mxfp4"), world_size=2,
                 cuda=False)
    with pytest.raises(ArgumentError, match=r"^mxfp4 with --context-parallel-size 2: its wgrad GEMM scales blocks "
                                            r"of 32 tokens, but each of the 2 x CP chunks of a micro-batch holds 16 "
                                            r"\(--seq-length 64 / 4 x --micro-batch-size 1\)"):
        parse_config(train_args(tiny_data, "--context-parallel-size", "2", "--precision", "mxfp4",
                                "--micro-batch-size", "1"), world_size=2, cuda=False)


# ----------------------------------------------------------------------------------------------
# Four processes: the attention module at CP=4 and CP=2 against full causal attention


def _reference(q, k, v, allowed, scale):
    """Softmax attention written out, [s, b, n, hn] in and out (kv heads repeated per query group)."""
    k, v = (t.repeat_interleave(q.size(2) // t.size(2), dim=2) for t in (k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(q.size(0), q.size(1), -1)


def _reset_mask() -> torch.Tensor:
    """megatron's --reset-attention-mask mask (True = masked): causal, documents restart at 5, 13 and 22."""
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    for start in (5, 13, 22):
        allowed[start:, :start] = False
    return (~allowed).expand(BATCH, 1, SEQ, SEQ)


def _on_this_rank(t: torch.Tensor) -> torch.Tensor:
    """This CP rank's rows of a sequence-first tensor, cut by megatron-core's own function."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank({"t": t.transpose(0, 1)})["t"].transpose(0, 1)


def _attention_checks(config) -> dict:
    """Max |difference| of output, dq, dk, dv from the reference, per case, on this rank."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_snip.model.attention import SDPAttention

    g = torch.Generator().manual_seed(11)
    full = [torch.randn(SEQ, BATCH, n, HEAD_DIM, generator=g, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS)]
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    module = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    out = {}
    for case, mask in (("causal", None), ("mask", _reset_mask())):
        want_inputs = [t.clone().requires_grad_() for t in full]
        want = _reference(*want_inputs, causal if mask is None else ~mask, module.softmax_scale)
        want.backward(grad_out)
        wants = [want.detach(), *(t.grad for t in want_inputs)]
        local_mask = None if mask is None else get_batch_on_this_cp_rank({"attention_mask": mask})["attention_mask"]
        for recompute in (False, True):
            inputs = [_on_this_rank(t).requires_grad_() for t in full]
            saved = []  # elements of the storage behind each tensor kept for backward (a slice keeps all of it)

            def keep(t, saved=saved):
                saved.append(t.untyped_storage().nbytes() // t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                if recompute:  # what megatron's SelfAttention does under --recompute-granularity selective
                    got = tensor_parallel.checkpoint(module, False, *inputs, local_mask)
                else:
                    got = module(*inputs, local_mask)
            got.backward(_on_this_rank(grad_out))
            gots = [got.detach(), *(t.grad for t in inputs)]
            name = f"{case}{'_recompute' if recompute else ''}"
            out[name] = max((a - _on_this_rank(b)).abs().max().item() for a, b in zip(gots, wants))
            out[f"{name}_largest_saved"] = max(saved)
    out["local_kv_numel"] = SEQ // config.context_parallel_size * BATCH * GROUPS * HEAD_DIM
    return out


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.compat.cpu import enable
    from megatron_snip.model.llama import transformer_config

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    run = run_config("--hidden-size", str(HEADS * HEAD_DIM), "--num-attention-heads", str(HEADS),
                     "--num-query-groups", str(GROUPS), "--seq-length", str(SEQ))
    results = {}
    for cp in (4, 2):
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        config = dataclasses.replace(transformer_config(run.model, run.parallel), context_parallel_size=cp)
        results[cp] = _attention_checks(config)
        parallel_state.destroy_model_parallel()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_attention")
    mp.spawn(worker, args=(4, free_port(), str(out)), nprocs=4, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.integration
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_cp_ranks_equals_full_causal_attention(results, cp):
    """Every rank's output and its query, key and value gradients, with GQA, causal and masked, in fp64."""
    for rank, per_rank in enumerate(results):
        got = per_rank[cp]
        for case in ("causal", "mask", "causal_recompute", "mask_recompute"):
            assert got[case] < EXACT, (rank, case, got[case])


@pytest.mark.integration
def test_selective_recompute_keeps_only_the_local_keys_and_values(results):
    """Without recompute the gathered keys and values (CP times this rank's) are kept for backward; under
    megatron-core's checkpoint of the core attention only the local query, key and value tensors are."""
    for per_rank in results:
        got = per_rank[2]
        local_q = got["local_kv_numel"] * HEADS // GROUPS
        assert got["causal_largest_saved"] == 2 * got["local_kv_numel"]  # a gathered K or V
        assert got["causal_recompute_largest_saved"] == local_q
