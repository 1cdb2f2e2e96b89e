"""Training on one GPU: every precision and SNIP through pretrain_llama.py, on the GPU code paths
(NCCL, CUDA kernels, the compiled Triton quantizers, ``torch._scaled_mm``), and the attention softmax
on a GPU without apex. The training cases need CUDA and skip without it (bench/gpu_suite.py runs
them on a GPU); the softmax case runs everywhere."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from conftest import scalars, torchrun, train_args

from megatron_snip.arguments import parse_config
from megatron_snip.model import llama
from megatron_snip.training import tags

pytestmark = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
LOSS, FP4 = tags.LM_LOSS, tags.FP4_FRACTION


def fp8_tensor_cores() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.integration
@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4", "mxfp4"])
def test_one_gpu_trains_in_each_precision(tiny_data, tmp_path, precision):
    proc = torchrun(1, train_args(tiny_data, "--bf16", "--precision", precision,
                                  "--log-memory-to-tensorboard", "--tensorboard-dir", str(tmp_path / "tb"), iters=12))
    log = proc.stdout + proc.stderr
    assert "operands quantized by fused Triton kernels" in log, "the GPU run should quantize with the kernels"
    if precision == "fp8":
        assert ("FP8 GEMMs on torch._scaled_mm" in log) == fp8_tensor_cores()
    losses = scalars(tmp_path / "tb", LOSS)
    assert sorted(losses) == list(range(1, 13)) and all(math.isfinite(v) for v in losses.values())
    assert losses[12] < losses[1] - 0.3
    assert set(scalars(tmp_path / "tb", FP4).values()) == {1.0 if precision in ("nvfp4", "mxfp4") else 0.0}
    assert scalars(tmp_path / "tb", tags.MEM_MAX_ALLOCATED)[12] > 0


@pytest.mark.integration
@needs_cuda
def test_one_gpu_snip_replans_and_trains(tiny_data, tmp_path):
    torchrun(1, train_args(tiny_data, "--bf16", "--snip", "--snip-fp4-target", "0.5", "--snip-interval", "3",
                           "--snip-probe-passes", "1", "--lr-decay-style", "constant",
                           "--tensorboard-dir", str(tmp_path / "tb"), iters=6))
    fp4 = scalars(tmp_path / "tb", FP4)
    assert fp4[1] == fp4[3] == 0.0 and fp4[4] >= 0.5 - 1e-9
    assert sorted(scalars(tmp_path / "tb", tags.snip("fp4 flops fraction"))) == [3, 6]
    losses = scalars(tmp_path / "tb", LOSS)
    assert all(math.isfinite(v) for v in losses.values()) and losses[6] < losses[1]


def test_attention_softmax_runs_without_the_fused_kernels(tiny_data, monkeypatch):
    """On a GPU without apex, megatron-core's fused softmax has no kernels: the model's config must
    leave it off, so megatron-core's softmax module computes torch's masked softmax (here on CPU,
    the same code path as on such a GPU), where the fused path would fail at the first forward."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    # Without gradient accumulation fusion: its start-up check runs a GEMM on the (here pretended) GPU.
    run = parse_config(train_args(tiny_data, "--bf16", "--no-gradient-accumulation-fusion"), world_size=1, cuda=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    config = llama.transformer_config(run.model, run.parallel)
    assert config.masked_softmax_fusion == llama.fused_softmax_available()

    def softmax(fusion: bool) -> FusedScaleMaskSoftmax:
        return FusedScaleMaskSoftmax(input_in_fp16=False, input_in_bf16=True, attn_mask_type=AttnMaskType.causal,
                                     scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func,
                                     softmax_in_fp32=True, scale=None)

    scores = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    mask = torch.ones(64, 64, dtype=torch.bool).triu(diagonal=1)[None, None]
    expected = torch.softmax(scores.float().masked_fill(mask, -10000.0), dim=-1).bfloat16()
    assert torch.equal(softmax(config.masked_softmax_fusion)(scores, mask), expected)
    if not llama.fused_softmax_available():  # what the config avoids
        with pytest.raises(ModuleNotFoundError):
            softmax(True)(scores, mask)


@pytest.mark.integration
@needs_cuda
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine")
def test_one_gpu_snip_drives_transformer_engine(tiny_data, tmp_path):
    """SNIP on the te backend: TE's per-module recipes from its plans, re-planned without a restart.
    Below Blackwell TE has no NVFP4 GEMMs: SNIP plans FP8 against a time budget instead."""
    blackwell = torch.cuda.get_device_capability() >= (10, 0)
    budget = ("--snip-fp4-target", "0.5") if blackwell else ("--snip-time-target", "0.7")
    proc = torchrun(1, train_args(tiny_data, "--bf16", "--transformer-impl", "transformer_engine", "--snip", *budget,
                                  "--snip-interval", "3", "--snip-probe-passes", "1", "--lr-decay-style", "constant",
                                  "--tensorboard-dir", str(tmp_path / "tb"), iters=6))
    log = proc.stdout + proc.stderr
    assert "precision backend te: Transformer Engine" in log
    assert sorted(scalars(tmp_path / "tb", tags.snip("fp4 flops fraction"))) == [3, 6]
    if blackwell:
        assert scalars(tmp_path / "tb", FP4)[4] >= 0.5 - 1e-9
    else:
        assert "SNIP candidate nvfp4 dropped" in log
        assert scalars(tmp_path / "tb", tags.snip("estimated gemm time vs bf16"))[3] <= 0.7 + 1e-9
    losses = scalars(tmp_path / "tb", LOSS)
    assert all(math.isfinite(v) for v in losses.values()) and losses[6] < losses[1]
