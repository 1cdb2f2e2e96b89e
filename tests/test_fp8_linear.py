"""The fast FP8 linear: fused casts to FP8 bytes and scales feeding ``torch._scaled_mm``.

The casts (``triton_fp8.py``) must write the reference quantizer's bytes and scales bit for bit
(``fp8.py``: ``to_elements(x * scale)``, ``1 / scale``; per-row: ``quantize_fp8_block`` with one block
per row). On CPU the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1) and
``torch._scaled_mm`` has a CPU implementation, so the very code path a GPU runs is checked here; with
CUDA the same tests run compiled on the GPU (the byte-equality tests are the GPU's acceptance test).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_fp8_gemm import run_layer

from megatron_snip.numerics import fp8_gemm, triton_fp8
from megatron_snip.numerics.blocks import tensor_amax
from megatron_snip.numerics.formats import E4M3, E5M2, to_elements
from megatron_snip.numerics.fp8 import fp8_scale_from_amax, quantize_fp8_block
from megatron_snip.numerics.linear import LinearQuantization, QuantState, quantized_linear
from megatron_snip.numerics.recipes import Precision, RecipeConfig
from megatron_snip.numerics.registry import ROW

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_GPU = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.cuda, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def operand(rows: int = 37, cols: int = 200, *, seed: int = 0, specials: bool = True) -> torch.Tensor:
    """Values over 10 decades (subnormal and saturating elements), a zero row, signed zeros, an fp32
    subnormal, and optionally a NaN and an Inf."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 4, cols)
    x[5, :] = 0.0
    x[6, 17] = -0.0
    x[8, 3] = 1e-42
    if specials:
        x[3, 5] = float("nan")
        x[7, 100] = float("-inf")
    return x.to(DEVICE)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal FP8 bytes; a NaN may carry either sign (its sign is the arithmetic's, not the format's)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected.float())
    assert torch.equal(torch.isnan(actual.float()), nan), "NaN positions differ"
    a, e = actual.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan]
    assert torch.equal(a, e), f"{int((a != e).sum())} of {a.numel()} bytes differ"


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual.masked_fill(nan, 0).view(torch.int32), expected.masked_fill(nan, 0).view(torch.int32))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("layout", ["fp32", "bf16", "transposed"])
@pytest.mark.parametrize("specials", [False, True])
def test_tensorwise_cast_writes_the_reference_bytes_scale_and_transpose(fmt, layout, specials):
    x = operand(specials=specials)
    x = {"fp32": x, "bf16": x.to(torch.bfloat16), "transposed": x.t()}[layout]
    data, data_t, scale_inv = triton_fp8.cast_tensorwise(x, fmt, transpose=True)
    amax = tensor_amax(x.float())
    assert_same_bits(triton_fp8.tensor_amax_bits(x), amax)
    scale = fp8_scale_from_amax(amax, fmt)
    expected = to_elements(x.float() * scale, fmt)
    assert_same_bytes(data, expected)
    assert_same_bytes(data_t, expected.t().contiguous())
    assert data_t.is_contiguous() and data.is_contiguous()
    assert_same_bits(scale_inv, torch.reciprocal(scale))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_tensorwise_cast_with_a_tensor_parallel_amax_or_a_given_scale(fmt):
    x = operand(specials=False)
    amax = torch.tensor(3.0e5, device=DEVICE)  # the all-shard amax, larger than this shard's
    data, _, scale_inv = triton_fp8.cast_tensorwise(x, fmt, amax=amax)
    scale = fp8_scale_from_amax(amax, fmt)
    assert_same_bytes(data, to_elements(x * scale, fmt))
    assert_same_bits(scale_inv, torch.reciprocal(scale))
    given = torch.tensor(0.37, device=DEVICE)  # delayed scaling: the history's scale
    data, _, scale_inv = triton_fp8.cast_tensorwise(x, fmt, scale=given)
    assert_same_bytes(data, to_elements(x * given, fmt))
    assert_same_bits(scale_inv, torch.reciprocal(given))


@pytest.mark.parametrize("layout", ["rows", "columns", "bf16"])
@pytest.mark.parametrize("specials", [False, True])
def test_rowwise_cast_writes_the_reference_bytes_and_scales(layout, specials):
    x = operand(150, 300, specials=specials)
    x = {"rows": x, "columns": x.t(), "bf16": x.to(torch.bfloat16)}[layout]  # columns: wgrad's strided read
    data, scale_inv = triton_fp8.cast_rowwise(x)
    reference = quantize_fp8_block(x, block=(1, ROW))
    assert_same_bytes(data, reference.elements.to(torch.float8_e4m3fn))
    assert_same_bits(scale_inv.reshape(-1, 1), reference.scales)
    assert_same_bits(triton_fp8.row_amax(x), fp8_gemm.row_amax(x, None))


def test_rowwise_cast_with_row_amaxes_over_all_shards():
    x = operand(40, 64, specials=False)
    amax = fp8_gemm.row_amax(x, None) * 3.0  # as if another shard of each row held larger values
    data, scale_inv = triton_fp8.cast_rowwise(x, amax=amax)
    reference = quantize_fp8_block(x, block=(1, ROW), amax=amax)
    assert_same_bytes(data, reference.elements.to(torch.float8_e4m3fn))
    assert_same_bits(scale_inv.reshape(-1, 1), reference.scales)


def test_non_2d_or_non_fp8_casts_are_refused():
    with pytest.raises(ValueError, match="2-D"):
        triton_fp8.cast_tensorwise(torch.zeros(2, 3, 4, device=DEVICE), E4M3)
    from megatron_snip.numerics.formats import E2M1
    with pytest.raises(ValueError, match="E4M3 or E5M2"):
        triton_fp8.cast_rowwise(torch.zeros(2, 3, device=DEVICE), E2M1)


@pytest.fixture
def traced(monkeypatch):
    """Records the storage of every cast's output and the operands every _scaled_mm call reads."""
    casts, calls = set(), []
    fp8_gemm.rowwise_out_dtype_ok(torch.device(DEVICE), torch.float32)  # its one-time probe GEMM, before tracing
    real_cast, real_mm = triton_fp8._cast, torch._scaled_mm

    def cast(*args, **kwargs):
        out = real_cast(*args, **kwargs)
        casts.update(t.untyped_storage().data_ptr() for t in out[:2] if t is not None)
        return out

    def mm(a, b, **kwargs):
        calls.append((a, b))
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(triton_fp8, "_cast", cast)
    monkeypatch.setattr(torch, "_scaled_mm", mm)
    return casts, calls


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
@pytest.mark.parametrize("fp8_recipe", ["tensorwise", "delayed", "rowwise"])
def test_the_layer_reads_the_casts_bytes_without_copies_and_equals_the_reference_path(fp8_recipe, traced):
    """Every GEMM runs on _scaled_mm reading bytes the casts wrote (transposed copies included: no
    ``.contiguous()``), and the kernels path gives the reference bytes path's results bit for bit."""
    casts, calls = traced
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 48, 64, generator=g).to(DEVICE)
    w = (torch.randn(32, 64, generator=g) * 0.05).to(DEVICE)
    dy = torch.randn(2, 48, 32, generator=g).to(DEVICE)
    fast = run_layer(x, w, dy, "scaled_mm", fp8_recipe=fp8_recipe, kernels="triton", steps=2)
    assert len(calls) == 6, "fprop, dgrad and wgrad of both steps on the FP8 bytes"
    for a, b in calls:
        assert a.is_contiguous() and b.t().is_contiguous()
        assert {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()} <= casts
    reference = run_layer(x, w, dy, "scaled_mm", fp8_recipe=fp8_recipe, kernels="torch", steps=2)
    for actual, expected in zip(fast, reference):
        assert_same_bits(actual, expected)


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
def test_rowwise_scaled_mm_equals_its_emulation_within_accumulation_order():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=g).to(DEVICE)
    w = (torch.randn(48, 96, generator=g) * 0.1).to(DEVICE)
    dy = torch.randn(64, 48, generator=g).to(DEVICE)
    fast = run_layer(x, w, dy, "scaled_mm", fp8_recipe="rowwise", kernels="triton")
    emulated = run_layer(x, w, dy, "emulated", fp8_recipe="rowwise")
    u = 2.0**-24 if DEVICE == "cpu" else 2.0**-14  # Hopper's FP8 accumulator (see test_fp8_gemm.py)
    for actual, expected, (a, b) in zip(fast, emulated, ((x, w.t()), (dy, w), (dy.t(), x))):
        bound = 2 * 2 * (a.shape[1] + 2) * u * (a.abs() @ b.abs())  # operands within 2x of their FP8 values
        assert torch.all((actual - expected).abs() <= bound)


def test_row_amaxes_are_reduced_only_where_the_gemms_reduction_dim_is_split():
    """Column-parallel (W, dY split along out): dgrad reduces over the split dim; row-parallel (X, W
    split along in): fprop does. Other GEMMs see whole rows."""
    seen = []

    def reduce(t):
        seen.append(t.shape)
        return t

    x = torch.randn(8, 16)
    for sharded, split_gemm in ((frozenset({"w", "dy"}), "dgrad"), (frozenset({"x", "w"}), "fprop")):
        quant = LinearQuantization(Precision.uniform("fp8"), RecipeConfig(fp8_recipe="rowwise"), QuantState(),
                                   amax_reduce=reduce, sharded=sharded)
        for gemm in ("fprop", "dgrad", "wgrad"):
            seen.clear()
            amax = quant.row_amax(x.abs().amax(dim=1), gemm)
            assert (amax is not None) == (gemm == split_gemm) and len(seen) == (gemm == split_gemm)


@pytest.mark.skipif(not FP8_GPU, reason="needs FP8 tensor cores")
@pytest.mark.parametrize("fp8_recipe", ["tensorwise", "rowwise"])
def test_health_between_logged_steps_adds_no_kernel_on_the_fp8_bytes_path(fp8_recipe, monkeypatch):
    """Off the logged steps, quantization health flags non-finite operands from the amaxes the casts
    computed anyway and GEMM outputs from the bound of their operands' scales: no reduction of its own
    runs during the step, and the flags still name where a NaN entered or which GEMM overflowed."""
    from megatron_snip.numerics.health import HealthStats, summarize

    recipe = RecipeConfig(fp8_recipe=fp8_recipe, kernels="triton", fp8_gemm="scaled_mm")
    reductions = []
    for name in ("aminmax", "amax", "count_nonzero", "isfinite"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, _name=name, **k: reductions.append(_name) or
                            _real(*a, **k))

    def step(x, w):
        state = QuantState()
        state.health = HealthStats()
        state.health.reset(full=False)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        quantized_linear(xr, wr, Precision.uniform("fp8"), recipe, state).backward(torch.ones(x.shape[0], w.shape[0],
                                                                                              device=DEVICE))
        during = list(reductions)
        rows = {k: summarize(r.tolist())["nonfinite"] for k, r in state.health.rows.items()}
        return during, rows

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(32, 64, generator=g).to(DEVICE), torch.randn(48, 64, generator=g).to(DEVICE)
    during, rows = step(x, w)
    assert during == [] and rows == dict.fromkeys(["fprop.x", "fprop.w", "fprop.y", "dgrad.dy", "dgrad.dx"], 0)
    bad = x.clone()
    bad[3, 7] = float("nan")
    assert step(bad, w)[1]["fprop.x"] == 1
    huge = step(torch.full((32, 64), 1e20, device=DEVICE), torch.full((48, 64), 1e20, device=DEVICE))[1]
    assert huge["fprop.x"] == huge["fprop.w"] == 0 and huge["fprop.y"] == 1  # the GEMM made the Inf


def test_a_compiled_region_runs_the_quantized_linear_eagerly_and_exactly():
    """torch.compile around the linear breaks the graph at it (torch.compiler.disable) and gives the eager bits."""
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 32, generator=g).to(DEVICE), torch.randn(16, 32, generator=g).to(DEVICE)
    recipe = RecipeConfig(kernels="torch", fp8_gemm="emulated")

    def block(t):
        return torch.nn.functional.silu(quantized_linear(t * 2, w, Precision.uniform("fp8"), recipe, QuantState())) + 1

    compiled = torch.compile(block, backend="eager")
    assert_same_bits(compiled(x), block(x))
    explained = torch._dynamo.explain(block)(x)
    assert explained.graph_break_count >= 1


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
@pytest.mark.parametrize("layout", ["rows", "columns", "bf16"])
def test_blockwise_cast_writes_the_reference_bytes_and_block_scales(block, layout):
    x = operand(150, 300)
    x = {"rows": x, "columns": x.t(), "bf16": x.to(torch.bfloat16)}[layout]
    data, data_t, scale_inv = triton_fp8.cast_blockwise(x, block, transpose=True)
    reference = quantize_fp8_block(x, block=block)
    expected = reference.elements.to(torch.float8_e4m3fn)
    assert_same_bytes(data, expected)
    assert_same_bytes(data_t, expected.t().contiguous())
    assert_same_bits(scale_inv, reference.scales)


def _block_scales(scale: torch.Tensor, recipe, shape: tuple[int, int], transposed: bool) -> torch.Tensor:
    """A block grid as a full (rows, cols) tensor of scales, by the layout fp8_gemm assumes torch reads."""
    block = (128, 128) if recipe == torch.nn.functional.ScalingType.BlockWise128x128 else (1, 128)
    rows, cols = shape[::-1] if transposed else shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return full.t() if transposed else full


def test_blockwise_layers_feed_the_block_scaled_gemm_consistent_operands(monkeypatch):
    """Where torch's block-scaled GEMM runs (Hopper), fprop, dgrad and wgrad hand it bytes and scale grids
    that, read by the layout the first-use check settles on, give the emulated GEMMs' results. On CPU
    torch has no such GEMM: a stand-in reads the scales by the contract fp8_gemm assumes (A's grid
    (M, K / 128); B's 1x128 grid as B^T's, (N, K / 128); B's tiles (K / 128, N / 128)), so this checks
    the operands, orientations and the fallback, not cuBLAS (the GPU run does, through the same check)."""
    calls = []

    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        calls.append((recipe_a, recipe_b))
        transposed = recipe_b != torch.nn.functional.ScalingType.BlockWise128x128
        sa = _block_scales(scale_a, recipe_a, tuple(a.shape), False)
        sb = _block_scales(scale_b, recipe_b, tuple(b.shape), transposed)
        return ((a.float() * sa) @ (b.float() * sb)).to(output_dtype)

    monkeypatch.setattr(fp8_gemm, "blockwise_enabled", lambda device: True)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", scaled_mm)
    fp8_gemm._BLOCK_LAYOUTS.clear()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(256, 256, generator=g).to(DEVICE)
    w = (torch.randn(128, 256, generator=g) * 0.1).to(DEVICE)
    dy = torch.randn(256, 128, generator=g).to(DEVICE)
    fast = run_layer(x, w, dy, "scaled_mm", fp8_recipe="blockwise", kernels="triton")
    layouts = fp8_gemm.blockwise_layouts()
    assert len(layouts) == 3 and None not in layouts.values(), "fprop, dgrad and wgrad ran block-scaled"
    assert {r for call in calls for r in call} == {torch.nn.functional.ScalingType.BlockWise1x128,
                                                    torch.nn.functional.ScalingType.BlockWise128x128}
    emulated = run_layer(x, w, dy, "emulated", fp8_recipe="blockwise")
    for actual, expected, (a, b) in zip(fast, emulated, ((x, w.t()), (dy, w), (dy.t(), x))):
        bound = 2 * 2 * (a.shape[1] + 2) * 2.0**-24 * (a.abs() @ b.abs())
        assert torch.all((actual - expected).abs() <= bound)
    fp8_gemm._BLOCK_LAYOUTS.clear()


@pytest.mark.skipif(DEVICE == "cpu" or not fp8_gemm.blockwise_enabled(torch.device(DEVICE)),
                    reason="torch's block-scaled FP8 GEMM runs on Hopper (sm_90)")
def test_on_hopper_every_blockwise_gemm_runs_on_torchs_block_scaled_gemm():
    """The acceptance test of the real kernel: fprop, dgrad and wgrad each find a scale layout under which
    cuBLAS's block-scaled GEMM agrees with the emulation (else they would run emulated)."""
    fp8_gemm._BLOCK_LAYOUTS.clear()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(512, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(384, 256, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    dy = torch.randn(512, 384, generator=g).to(DEVICE, torch.bfloat16)
    run_layer(x, w, dy, "scaled_mm", fp8_recipe="blockwise", kernels="triton")
    layouts = fp8_gemm.blockwise_layouts()
    assert len(layouts) == 3 and None not in layouts.values(), layouts
