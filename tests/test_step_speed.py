"""The BF16 step's speed: its host synchronisations, and its fused pieces (megatron-core's SwiGLU fusion, the
weight-gradient accumulation into main_grad, the fused AdamW; the rest of the optimizer step is
test_optimizer_step.py's). The fusions are
CUDA-only: on a CPU their math is checked and their flags are shown to leave CPU runs as they were; on a GPU
(pytest -m cuda) they run, and the step's synchronisations are counted."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import free_port, in_world_of_one, run_config

CUDA = torch.cuda.is_available()
NO_GROUP = object()  # a context-parallel group for calls that never read it (without process groups)
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_megatrons_swiglu_fusion_computes_swiglu(dtype):
    """megatron-core's fused SwiGLU (its own backward formula) against autograd through silu(a) * b. On a CPU
    its compiled kernels run eagerly (the formulas are checked); on a GPU they are compiled."""
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 2, 96, generator=g).to(DEVICE, dtype).requires_grad_()
    dy = torch.randn(16, 2, 48, generator=g).to(DEVICE, dtype)
    with torch.compiler.set_stance("default" if CUDA else "force_eager"):
        fused = bias_swiglu_impl(x, None)
        (dx,) = torch.autograd.grad(fused, x, dy)
    a, b = torch.chunk(x, 2, -1)
    plain = F.silu(a) * b
    (want_dx,) = torch.autograd.grad(plain, x, dy)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert (fused - plain).abs().max() <= tol * plain.abs().max()
    assert (dx - want_dx).abs().max() <= tol * want_dx.abs().max()


@pytest.mark.cuda
def test_rope_fusion_slot_computes_megatrons_rope(monkeypatch):
    """Where Transformer Engine is absent, megatron-core's RoPE fusion calls our compiled RoPE: it computes what
    megatron-core's unfused path does (to the bit with its kernels eager, on a CPU; compiled on a GPU)."""
    import dataclasses

    from megatron.core.models.common.embeddings import rope_utils

    from megatron_snip.model.fusions import fused_rope
    from megatron_snip.model.llama import transformer_config

    if rope_utils.fused_apply_rotary_pos_emb is None:
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_rope)
    run = run_config()
    unfused = transformer_config(run.model, run.parallel)
    fused = dataclasses.replace(unfused, apply_rope_fusion=True)
    g = torch.Generator().manual_seed(4)
    t = torch.randn(64, 2, 4, 16, generator=g).to(DEVICE).requires_grad_()
    freqs = (torch.arange(64.0)[:, None] * torch.rand(8, generator=g)).repeat(1, 2)[:, None, None, :].to(DEVICE)
    dy = torch.randn(64, 2, 4, 16, generator=g).to(DEVICE)
    with torch.compiler.set_stance("default" if CUDA else "force_eager"):
        out = rope_utils.apply_rotary_pos_emb(t, freqs, config=fused, cp_group=NO_GROUP)
        (dt,) = torch.autograd.grad(out, t, dy)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, config=unfused, cp_group=NO_GROUP)
    (want_dt,) = torch.autograd.grad(want, t, dy)
    tol = 1e-6 if CUDA else 0.0
    assert (out - want).abs().max() <= tol and (dt - want_dt).abs().max() <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_rope_is_megatrons_unfused_rope_to_the_bit(dtype):
    """The unfused RoPE with its cos/sin tables computed once per angles tensor (model/fusions.py): the same
    output and the same gradient as megatron-core's, to the bit; cases it does not take go to megatron-core's."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_snip.model.fusions import lean_rope

    unfused = getattr(rope_utils._apply_rotary_pos_emb_bshd, "__wrapped__", rope_utils._apply_rotary_pos_emb_bshd)
    lean = lean_rope(unfused)
    g = torch.Generator().manual_seed(4)
    freqs = torch.randn(32, 1, 1, 64, generator=g) * 3
    for _ in range(2):  # the second call reads the cached tables
        outs = []
        for fn in (unfused, lean):
            t = (torch.randn(32, 2, 4, 64, generator=torch.Generator().manual_seed(5))).to(dtype).requires_grad_()
            y = fn(t, freqs)
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(dtype))
            outs.append((y.detach(), t.grad))
        (y0, dt0), (y1, dt1) = outs
        assert torch.equal(y0, y1) and torch.equal(dt0, dt1)
    t = torch.randn(32, 2, 4, 64, generator=g)
    assert torch.equal(lean(t, freqs, mscale=0.5), unfused(t, freqs, mscale=0.5))  # megatron-core's own path
    assert torch.equal(lean(t, freqs[..., :32]), unfused(t, freqs[..., :32]))  # a partial rotation


def test_cpu_runs_keep_the_unfused_path():
    """Without CUDA the RoPE, SwiGLU and wgrad fusions stay off whatever the flags say: CPU runs are unchanged."""
    from megatron_snip.model.llama import transformer_config

    off = ("--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion")
    for flags in ((), ("--bf16",), off):
        run = run_config(*flags)
        config = transformer_config(run.model, run.parallel)
        assert config.bias_activation_fusion == config.apply_rope_fusion == (CUDA and flags != off)
        if not CUDA:
            assert not config.gradient_accumulation_fusion
    model = run_config().model
    assert model.apply_rope_fusion and model.bias_swiglu_fusion and model.gradient_accumulation_fusion  # Megatron's


def test_torch_wgrad_accumulation_adds_the_product_in_place():
    """apex's contract: main_grad += grad_output^T @ total_input, in place (the bf16 buffer case runs anywhere)."""
    from megatron_snip.model.fusions import TorchWgradAccumulation

    g = torch.Generator().manual_seed(2)
    x, dy = (torch.randn(64, n, generator=g).to(DEVICE, torch.bfloat16) for n in (32, 16))
    main = torch.randn(16, 32, generator=g).to(DEVICE, torch.bfloat16)
    want = (main.float() + dy.float().t() @ x.float())
    ptr = main.data_ptr()
    TorchWgradAccumulation.wgrad_gemm_accum_fp16(x, dy, main)
    assert main.data_ptr() == ptr and (main.float() - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.cuda
def test_wgrad_fusion_is_available_on_this_gpu_or_says_why():
    from megatron_snip.model.fusions import enable_wgrad_accumulation_fusion

    why_not = enable_wgrad_accumulation_fusion()
    if not CUDA:
        assert why_not == "it needs CUDA"
    else:
        assert why_not is None, why_not


def test_fused_adam_where_torch_has_the_kernel():
    """torch's fused Adam/AdamW kernel runs on a GPU and on a CPU, and takes over from an unfused state."""
    from megatron_snip.training.setup import use_fused_adam

    class Wrapper:  # megatron-core's optimizers hold the torch one as .optimizer
        def __init__(self, params):
            self.optimizer = torch.optim.AdamW(params, lr=1e-3)

    param = torch.nn.Parameter(torch.randn(4, 4, device=DEVICE))
    wrapped = Wrapper([param])
    param.grad = torch.ones_like(param)
    wrapped.optimizer.step()  # unfused: the step counter lives on the host (as in an unfused run's checkpoint)
    assert use_fused_adam(wrapped) == 1
    assert wrapped.optimizer.param_groups[0]["fused"] is True
    wrapped.optimizer.step()  # and the fused kernel takes over from the unfused state
    assert float(wrapped.optimizer.state[param]["step"]) == 2.0
    assert wrapped.optimizer.state[param]["step"].device == param.device


@pytest.mark.cuda
def test_sdpa_writes_its_output_in_megatrons_layout():
    """SDPAttention hands SDPA [b, heads, s, hn] views of megatron's [s, b, heads, hn] tensors; SDPA's output keeps
    the query's memory layout, so turning it back into [s, b, heads * hn] is a view, not a copy."""
    s, b, heads, groups, hn = 128, 2, 8, 2, 64
    dtype = torch.bfloat16 if CUDA else torch.float32
    q, k, v = (torch.randn(s, b, n, hn, device=DEVICE, dtype=dtype).permute(1, 2, 0, 3)
               for n in (heads, groups, groups))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.permute(2, 0, 1, 3).is_contiguous()


# -- the fused weight-gradient accumulation inside a model (a GPU run) ----------------------------------------

def _main_grads(fusion: bool) -> dict:
    from megatron.core import tensor_parallel

    from megatron_snip.model.llama import build_model, transformer_config
    from megatron_snip.training.setup import wrap_ddp

    flags = ("--bf16",) + (() if fusion else ("--no-gradient-accumulation-fusion",))
    run = run_config(*flags, "--seq-length", "32", "--max-position-embeddings", "32")
    torch.manual_seed(5)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    config = transformer_config(run.model, run.parallel)
    (model,) = wrap_ddp(run.parallel, config, build_model(run.model, run.parallel, config, 128))
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    positions = torch.arange(32, device=DEVICE).expand(2, 32)
    model.zero_grad_buffer()
    for _ in range(2):  # two micro-batches accumulate
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()
    return {"fusion": config.gradient_accumulation_fusion,
            "grads": {n: p.main_grad.float().cpu().clone() for n, p in model.module.named_parameters()}}


def _with_and_without_fusion() -> dict:
    return {"on": _main_grads(True), "off": _main_grads(False)}


@pytest.mark.cuda
@pytest.mark.integration
@pytest.mark.skipif(not CUDA, reason="the fusion needs CUDA")
def test_fused_wgrad_accumulation_gives_the_unfused_gradients(tmp_path):
    """Every main_grad after two micro-batches, with and without the fusion (the fused product is not rounded
    to bf16 before it is added, so the two agree to bf16's precision, not to the bit)."""
    result = in_world_of_one(_with_and_without_fusion, tmp_path=tmp_path)
    assert result["on"]["fusion"] and not result["off"]["fusion"]
    for name, want in result["off"]["grads"].items():
        got = result["on"]["grads"][name]
        assert (got - want).abs().max() <= 2e-2 * want.abs().max() + 1e-6, name


# -- host synchronisations of a training step (a GPU run) -----------------------------------------------------

def sync_worker(rank: int, world: int, port: int, out_dir: str, argv: list[str]) -> None:
    import warnings

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    from megatron_snip.cli.pretrain import trainer_from_command_line

    trainer = trainer_from_command_line(argv)
    data = trainer.batches("train", 0)
    for _ in range(2):  # compile, allocator and cuBLAS warm-up
        trainer.train_step(data)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        trainer.train_step(data)
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    torch.save(syncs, os.path.join(out_dir, "syncs.pt"))
    torch.distributed.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.integration
@pytest.mark.skipif(not CUDA, reason="host synchronisations are a GPU matter")
def test_a_bf16_step_synchronises_with_the_host_twice(tiny_data, tmp_path):
    """The non-finite check's one read of its all-reduced flags and the gradient norm's (megatron-core's, for
    --clip-grad): nothing else in the step waits for the GPU (Megatron-LM's own step waits once per micro-batch
    for its NaN check, and once for the gradient norm)."""
    from conftest import train_args

    argv = train_args(tiny_data, "--bf16", "--clip-grad", "1.0", "--log-interval", "1000", iters=10)
    mp.spawn(sync_worker, args=(1, free_port(), str(tmp_path), argv), nprocs=1, join=True)
    syncs = torch.load(tmp_path / "syncs.pt")
    assert len(syncs) <= 2, syncs
