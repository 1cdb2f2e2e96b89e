"""--context-parallel-size: its flags and refusals, the chunk layout against megatron-core's, and the
modules that compute on a CP rank's part of each sequence.

Four gloo ranks (tests/drivers/context_parallel_checks.py) run, at CP=4 and then CP=2 (x DP2): the SDPA
attention in fp64, whose output and query, key and value gradients on every rank's chunks equal softmax
attention written out on the whole sequence (grouped-query attention, causal and under a
--reset-attention-mask mask; under megatron-core's selective recompute the gathered keys and values are
not kept for backward and the gradients stay exact); and a quantized linear, which quantizes a rank's
tokens as the whole batch's. The training-level parity runs are in tests/test_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, launch, run_config

EXACT = 1e-12  # fp64; a prototype matched to ~2e-15
QUANT_FORMATS = ("fp8", "fp8:delayed", "fp8:rowwise", "fp8:blockwise", "nvfp4", "mxfp4")


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
# One device, no process group: each CP rank's share of the attention (bench/cp_attention.py)


def _measure(monkeypatch, **sizes) -> dict:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from cp_attention import measure

    return measure(**sizes)


def test_cp_attention_bench_runs_at_tiny_sizes(monkeypatch):
    """The benchmark's measurement on this device (CPU in CI): both CP ranks' shares, timed, and their outputs and
    gradients equal fp32 SDPA over the whole sequence."""
    got = _measure(monkeypatch, seq=64, batch=1, heads=4, groups=2, head_dim=16, cp=2, dtype=torch.float32,
                   device=torch.device("cpu"), reps=1, warmup=0)
    assert len(got["ranks_s"]) == 2 and got["plain_s"] > 0 and got["speed"] > 0 and got["balance"] > 0
    assert got["errors_vs_fp32"]["plain"] < 1e-5 and got["errors_vs_fp32"]["cp"] < 1e-5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,cp", [(torch.bfloat16, 2), (torch.bfloat16, 4), (torch.float32, 2)],
                         ids=["bf16-cp2", "bf16-cp4", "fp32-cp2"])
def test_cp_attention_runs_fused_kernels_on_one_gpu(monkeypatch, dtype, cp):
    """On a GPU (a CP world of one, each rank's chunk layout in turn): the lower-right causal calls run flash
    (bf16, kv heads shared) or memory-efficient attention (fp32, heads expanded), never the math kernel (the
    measurement forbids it), and are as close to fp32 SDPA as plain causal SDPA in the same dtype is."""
    got = _measure(monkeypatch, seq=2048, batch=2, heads=8, groups=2, head_dim=64, cp=cp, dtype=dtype,
                   device=torch.device("cuda"), reps=3, warmup=1)
    errors = got["errors_vs_fp32"]
    assert errors["cp"] <= max(2 * errors["plain"], 1e-5), errors
    print(f"\nCP{cp} {dtype}: speed {got['speed']:.3f}, balance {got['balance']:.3f}, errors {errors}")


# ----------------------------------------------------------------------------------------------
# Four processes: the attention module at CP=4 and CP=2 against full causal attention


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_checks")
    launch(4, [], env={"CP_CHECKS_OUT": str(out)}, script=ROOT / "tests" / "drivers" / "context_parallel_checks.py")
    return [torch.load(out / f"rank{r}.pt") for r in range(4)]


@pytest.mark.integration
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_over_cp_ranks_equals_full_causal_attention(results, cp):
    """Every rank's output and its query, key and value gradients, with GQA, causal and masked, in fp64."""
    for rank, per_rank in enumerate(results):
        got = per_rank[cp]
        assert got["layout_is_megatrons"]  # ChunkLayout.local keeps what get_batch_on_this_cp_rank keeps
        for case in ("causal", "mask", "causal_recompute", "mask_recompute"):
            assert got[case] < EXACT, (rank, case, got[case])


@pytest.mark.integration
@pytest.mark.parametrize("cp", [2, 4])
def test_a_context_parallel_linear_quantizes_as_the_whole_batch_does(results, cp):
    """Per-tensor amaxes of X and dY (fp8 tensorwise, delayed, nvfp4's global scale) and the wgrad GEMM's per-row
    amaxes (rowwise) reduced over the CP group, and blocks along tokens (blockwise, nvfp4 with its Hadamard
    transform, mxfp4) within each chunk: every rank's outputs and input gradients, and the weight gradient
    summed over the CP ranks, equal the whole batch's up to the order of fp32 sums."""
    for rank, per_rank in enumerate(results):
        got = per_rank[cp]["quantization"]
        assert {name for name, _ in got} == set(QUANT_FORMATS)
        for name in QUANT_FORMATS:
            assert got[(name, True)] < 1e-5, (rank, name, got[(name, True)])
    for name in ("fp8", "fp8:delayed", "fp8:rowwise", "nvfp4"):  # without the reduction, some rank's scales differ
        reduced, alone = (max(per_rank[cp]["quantization"][(name, r)] for per_rank in results) for r in (True, False))
        # rowwise scales are powers of 2, which change only what falls below E4M3's normal range: 10x, not 100x
        assert alone > (10 if name == "fp8:rowwise" else 100) * reduced, (name, reduced, alone)


@pytest.mark.integration
def test_selective_recompute_keeps_only_the_local_keys_and_values(results):
    """Without recompute the gathered keys and values (CP times this rank's) are kept for backward; under
    megatron-core's checkpoint of the core attention only the local query, key and value tensors are."""
    for per_rank in results:
        got, local_kv = per_rank[2], per_rank["local_kv_numel"][2]
        assert got["causal_largest_saved"] == 2 * local_kv  # a gathered K or V
        assert got["causal_recompute_largest_saved"] == local_kv * per_rank["q_per_kv_head"]  # the local query
