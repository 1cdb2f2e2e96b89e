"""--torch-compile: compiled layers compute what eager ones do, keep the linears (precision, SNIP's hooks,
collectives) eager, recompile nothing on a re-plan, and train as eager training does at TP=2 across a
re-plan. On a CPU the compiled path runs with the aot_eager backend (traced graphs, eager kernels);
the compile flags themselves are checked without a process."""

from __future__ import annotations

import pytest
import torch
from conftest import in_world_of_one, launch, run_config, scalars, train_args
from test_parallel import LOSS, assert_close

from megatron_snip.arguments.errors import ArgumentError
from megatron_snip.numerics.recipes import Precision

SEQ = 32


def _build(compiled: bool, swiglu_fusion: bool = False):
    """A TP1 model built by the trainer's builders from fixed seeds, compiled with aot_eager or not;
    ``swiglu_fusion``: with megatron-core's fused SwiGLU (a CUDA default, forced on here)."""
    from megatron.core import tensor_parallel

    from megatron_snip.model.llama import build_model, transformer_config

    extra = ("--torch-compile", "--torch-compile-backend", "aot_eager") if compiled else ()
    run = run_config("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), *extra)
    torch.manual_seed(123)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    config = transformer_config(run.model, run.parallel)
    config.bias_activation_fusion = swiglu_fusion
    (model,) = build_model(run.model, run.parallel, config, 128)
    return model


def _loss_and_grads(model, tokens):
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def checks() -> dict:
    from torch._dynamo.utils import counters

    from megatron_snip.model.quantized.layers import PlanLinear

    tokens = torch.randint(0, 128, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    out = {"eager": _loss_and_grads(_build(False), tokens)}
    model = _build(True)
    out["compiled"] = _loss_and_grads(model, tokens)
    graphs = dict(counters["stats"])["unique_graphs"]
    linears = [m for m in model.modules() if isinstance(m, PlanLinear)]
    seen = []
    handle = linears[0].register_forward_hook(lambda module, args, output: seen.append(output[0].shape))
    _loss_and_grads(model, tokens)
    handle.remove()
    out["hook_calls"] = len(seen)
    # A re-plan: the precisions of some linears change between steps, as a SNIP cycle changes them.
    fp8, nvfp4 = Precision.parse("fp8"), Precision.parse("nvfp4")
    linears[1].precision, linears[5].precision = fp8, nvfp4
    out["replanned"] = _loss_and_grads(model, tokens)
    out["graphs"] = (graphs, dict(counters["stats"])["unique_graphs"])
    eager = _build(False)
    eager_linears = [m for m in eager.modules() if isinstance(m, PlanLinear)]
    eager_linears[1].precision, eager_linears[5].precision = fp8, nvfp4
    out["replanned_eager"] = _loss_and_grads(eager, tokens)
    with torch.no_grad():
        model.eval()
        positions = torch.arange(SEQ).expand(2, SEQ)
        out["eval"] = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().item()
    out["recompiles"] = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    # megatron-core's fused SwiGLU (its own autograd function, jit-compiled) traced into the compiled layers
    with torch.compiler.set_stance("force_eager"):  # its kernels eager, not inductor's (a minute on 2 cores)
        out["swiglu_eager"] = _loss_and_grads(_build(False, swiglu_fusion=True), tokens)
    out["swiglu_compiled"] = _loss_and_grads(_build(True, swiglu_fusion=True), tokens)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return in_world_of_one(checks, tmp_path=tmp_path_factory.mktemp("compile"))


def _assert_same(got, want, rel: float):
    (loss, grads), (want_loss, want_grads) = got, want
    assert loss == pytest.approx(want_loss, rel=rel)
    assert sorted(grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert (grads[name] - grad).abs().max() <= rel * grad.abs().max(), name


@pytest.mark.integration
def test_compiled_layers_compute_what_eager_layers_do(results):
    """aot_eager runs the traced graphs with eager kernels: the forward is the same to the bit, the backward
    differs only in the order of a few fp32 sums (the norms' backward is traced from its decomposition)."""
    (loss, _), (want, _) = results["compiled"], results["eager"]
    assert loss == want
    _assert_same(results["compiled"], results["eager"], rel=1e-6)


@pytest.mark.integration
def test_megatrons_swiglu_fusion_compiles_into_the_layers(results):
    _assert_same(results["swiglu_compiled"], results["swiglu_eager"], rel=1e-6)
    _assert_same(results["swiglu_eager"], results["eager"], rel=1e-5)  # the fused SwiGLU computes SwiGLU


@pytest.mark.integration
def test_linears_stay_eager_so_a_replan_recompiles_nothing(results):
    assert results["hook_calls"] == 1  # a hook on a linear module ran, in eager code
    before, after = results["graphs"]
    assert before == after and results["recompiles"] == 0
    _assert_same(results["replanned"], results["replanned_eager"], rel=1e-6)
    assert results["replanned"][0] != results["compiled"][0]  # the new precisions did run
    assert results["eval"] == pytest.approx(results["replanned_eager"][0], rel=1e-6)  # no_grad graphs, same plan


def test_compile_flags_are_validated():
    assert not run_config().model.torch_compile  # off by default
    config = run_config("--torch-compile")
    assert config.model.torch_compile and config.model.torch_compile_backend == "inductor"
    with pytest.raises(ArgumentError, match="--torch-compile with dropout"):
        run_config("--torch-compile", "--hidden-dropout", "0.1")
    with pytest.raises(ArgumentError, match="^--torch-compile-backend 'eager': expected one of 'inductor', "):
        run_config("--torch-compile", "--torch-compile-backend", "eager")


@pytest.mark.integration
def test_compiled_training_matches_eager_at_tp2_across_a_replan(tiny_data, init_ckpt, tmp_path):
    """TP=2 with sequence parallelism (the linears' collectives stay out of the graphs), the plan changed
    at step 3 by a precision schedule (every forward GEMM in fp8): the losses of eager training, to the
    last digits before the re-plan; after it fp8's rounding amplifies the backward's 1e-8 differences."""
    losses, logs = {}, {}
    for name, extra in (("eager", ()), ("compiled", ("--torch-compile", "--torch-compile-backend", "aot_eager"))):
        tb = tmp_path / name
        proc = launch(2, train_args(tiny_data, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                    "--precision-schedule", "fwd=fp8@3", "--load", str(init_ckpt),
                                    "--no-load-optim", "--no-load-rng", "--tensorboard-dir", str(tb), *extra,
                                    iters=5))
        losses[name], logs[name] = scalars(tb, LOSS), proc.stdout + proc.stderr
    before = {step: loss for step, loss in losses["eager"].items() if step < 3}
    assert_close({step: losses["compiled"][step] for step in before}, before, rel=1e-6)
    assert_close(losses["compiled"], losses["eager"], rel=2e-4)
    assert "recompile" not in logs["compiled"].lower()  # dynamo warns when a frame recompiles too often
