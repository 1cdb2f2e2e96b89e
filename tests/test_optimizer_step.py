"""The optimizer step without per-tensor loops (training/multi_tensor.py): the gradient norm, the clipping, the
mixed-precision and distributed optimizers' copies and AdamW run as foreach / fused kernels, so the number of
kernels a step launches does not grow with the number of parameters; and they compute megatron-core's own
fallback loops' values, to the bit."""

from __future__ import annotations

import pytest
import torch
from conftest import in_world_of_one, run_config

LAYOUTS = {"fp32": (), "bf16": ("--bf16",), "distributed": ("--use-distributed-optimizer",),
           "distributed-bf16": ("--use-distributed-optimizer", "--bf16"),
           "distributed-bf16-grads": ("--use-distributed-optimizer", "--bf16", "--grad-reduce-in-bf16")}


def test_device_grad_norm_is_megatrons_fallback_to_the_bit():
    """megatron-core's local multi-tensor L2 norm (a host copy per tensor) and ours give the same fp32 [1]."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    from megatron_snip.compat import cpu
    from megatron_snip.training.multi_tensor import l2_norm

    cpu.enable()  # megatron's fallback writes its result to "cuda"
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        tensors = [torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g)
                   * 10.0 ** int(torch.randint(-8, 8, (1,), generator=g)) for _ in range(37)]
        want, got = local_multi_tensor_l2_norm(0, None, [tensors], False)[0], l2_norm(0, None, [tensors], False)[0]
        assert got.dtype == want.dtype and got.shape == want.shape == (1,) and torch.equal(got, want)


@pytest.mark.parametrize("aliased", [True, False])
@pytest.mark.parametrize("factor", [0.3, 1.0])
def test_foreach_scale_is_megatrons_fallback_to_the_bit(aliased, factor):
    from megatron.core.utils import local_multi_tensor_scale

    from megatron_snip.training.multi_tensor import scale

    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(n, generator=g) for n in (5, 300, 4097)]
    outs = []
    for fn in (local_multi_tensor_scale, scale):
        src = [t.clone() for t in srcs]
        dst = src if aliased else [torch.empty(t.shape, dtype=torch.bfloat16) for t in src]
        fn(0, None, [src, dst], factor)
        outs.append(dst)
    for want, got in zip(*outs):
        assert torch.equal(want, got)


def test_install_fills_only_the_fallback_slots():
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    from megatron_snip.training import multi_tensor

    multi_tensor.install()
    multi_tensor.install()  # idempotent
    for slot in (clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl):
        assert slot is not utils.local_multi_tensor_scale  # ours, or apex's / TE's kernel
    assert clip_grads.l2_norm_impl is not utils.local_multi_tensor_l2_norm
    assert mcore_optimizer._multi_tensor_copy_this_to_that.foreach


def _optimizer(layers: int, flags: tuple[str, ...]):
    from megatron.core import tensor_parallel

    from megatron_snip.model.llama import build_model, transformer_config
    from megatron_snip.training.setup import build_optimizer, wrap_ddp

    run = run_config("--num-layers", str(layers), "--clip-grad", "1.0", *flags)
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = transformer_config(run.model, run.parallel)
    chunks = wrap_ddp(run.parallel, config, build_model(run.model, run.parallel, config, 128))
    return chunks, build_optimizer(run.training, run.model, run.parallel, chunks)


def _megatrons_loops(optimizer) -> None:
    """megatron-core's own fallbacks back in their slots, and its own copy methods on ``optimizer``."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    clip_grads.l2_norm_impl = utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = mcore_optimizer.multi_tensor_scale_impl = utils.local_multi_tensor_scale
    mcore_optimizer._multi_tensor_copy_this_to_that = _loop_copy
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.__dict__.pop("_copy_main_params_to_model_params", None)
        inner.__dict__.pop("_copy_model_grads_to_main_grads", None)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten operations that compute (views and aliases, such as megatron-core's per-parameter
    ``.detach()`` of a gradient, launch no kernel and are not counted)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def _steps(layers: int, flags: tuple[str, ...], loops: bool) -> dict:
    """Three optimizer steps on seeded gradients: the weights after them, and the computing aten operations the
    last step dispatched."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl,
             mcore_optimizer._multi_tensor_copy_this_to_that)
    chunks, optimizer = _optimizer(layers, flags)
    try:
        if loops:
            _megatrons_loops(optimizer)
        g = torch.Generator().manual_seed(2)
        ops = _Ops()
        for step in range(3):
            for chunk in chunks:
                for p in chunk.module.parameters():
                    p.main_grad.copy_(torch.randn(p.shape, generator=g) * 0.1)
            if step == 2:
                with ops:
                    optimizer.step()
            else:
                optimizer.step()
        weights = {n: p.detach().float().clone() for n, p in chunks[0].module.named_parameters()}
    finally:
        (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, mcore_optimizer.multi_tensor_scale_impl,
         mcore_optimizer._multi_tensor_copy_this_to_that) = saved
    return {"weights": weights, "ops": ops.count, "params": len(weights)}


def _loop_copy(this, that, overflow_buf=None):
    """megatron-core's ``_multi_tensor_copy_this_to_that`` without a multi-tensor kernel: its loop."""
    if overflow_buf is not None:
        from megatron.core.optimizer import optimizer as mcore_optimizer

        overflow_buf.fill_(0)
        mcore_optimizer.multi_tensor_applier(mcore_optimizer.multi_tensor_scale_impl, overflow_buf, [this, that], 1.0)
    else:
        for this_, that_ in zip(this, that):
            that_.copy_(this_)


def checks() -> dict:
    return {name: {"foreach": [_steps(layers, flags, loops=False) for layers in (2, 4)],
                   "loops": [_steps(layers, flags, loops=True) for layers in (2, 4)]}
            for name, flags in LAYOUTS.items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return in_world_of_one(checks, tmp_path=tmp_path_factory.mktemp("optimizer_step"))


@pytest.mark.integration
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_step_launches_as_many_kernels_for_twice_the_tensors(results, layout):
    """The gradient norm, the clipping, the copies and AdamW of 2 layers and of 4 (twice the tensors) dispatch
    the same number of operations: nothing in the step loops over the tensors. megatron-core's own fallbacks
    dispatch more for more tensors (what the test would see of a loop)."""
    small, large = results[layout]["foreach"]
    assert large["params"] > small["params"] + 10
    assert large["ops"] == small["ops"], (small["ops"], large["ops"])
    loops_small, loops_large = results[layout]["loops"]
    assert loops_large["ops"] > loops_small["ops"]


@pytest.mark.integration
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_foreach_step_gives_megatrons_weights_to_the_bit(results, layout):
    for foreach, loops in zip(results[layout]["foreach"], results[layout]["loops"]):
        assert foreach["weights"].keys() == loops["weights"].keys()
        for name, want in loops["weights"].items():
            assert torch.equal(foreach["weights"][name], want), name
