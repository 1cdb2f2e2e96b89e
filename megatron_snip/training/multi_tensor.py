"""The optimizer step's multi-tensor kernels, where megatron-core would loop over tensors in Python.

Without apex or Transformer Engine megatron-core falls back to per-tensor loops for what their
multi-tensor kernels do: ``local_multi_tensor_scale`` (gradient clipping, and the mixed-precision
optimizer's copies of its fp32 main weights into the model's) does ``dst.copy_(src * scale)`` per
tensor, the bf16 optimizer copies its weights one ``copy_`` at a time, and
``local_multi_tensor_l2_norm`` reads every tensor's norm on the host. The distributed optimizer loops
over its parameters for its copies with or without apex. :func:`install` supplies what apex would
(torch's ``_foreach`` kernels: one call over all tensors, on any device), in megatron-core's own slots;
:func:`use_foreach_copies` gives a megatron-core optimizer foreach copies of its parameters and
gradients. The values are the loops' own (the same elementwise products and copies).

What remains per parameter in the step is bookkeeping that launches nothing: megatron-core's filters
of the parameters whose gradients enter the norm, and handing each main parameter its gradient (a
view of the gradient buffer), as torch's own optimizers collect their tensors.
"""

from __future__ import annotations

import types

import torch


def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's ``local_multi_tensor_l2_norm`` (the same values: the norm of the per-tensor norms)
    without copying each tensor's norm to the host (one sync per parameter on a GPU)."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1).float(), None


def scale(chunk_size, noop_flag, tensor_lists, factor):
    """apex's ``multi_tensor_scale`` as megatron-core calls it: ``dst = src * factor`` for every pair of
    ``tensor_lists`` = [srcs, dsts], in foreach kernels (``noop_flag`` is ignored, as megatron-core's own
    fallback ignores it)."""
    srcs, dsts = tensor_lists
    if not srcs:
        return
    if factor == 1.0:
        torch._foreach_copy_(dsts, srcs)
    elif all(s is d for s, d in zip(srcs, dsts)):
        torch._foreach_mul_(dsts, factor)
    else:
        torch._foreach_copy_(dsts, torch._foreach_mul(srcs, factor))


def copy_this_to_that(this: list[torch.Tensor], that: list[torch.Tensor], overflow_buf=None) -> None:
    """megatron-core's ``_multi_tensor_copy_this_to_that`` (a loop of ``copy_`` for bf16) as one foreach copy."""
    if this:
        torch._foreach_copy_(that, this)


def install() -> None:
    """Put :func:`l2_norm`, :func:`scale` and :func:`copy_this_to_that` in megatron-core's slots where it holds
    its local fallbacks (apex's or Transformer Engine's kernels, where installed, stay). Idempotent."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = l2_norm
    if clip_grads.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = scale
    if mcore_optimizer.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
        mcore_optimizer.multi_tensor_scale_impl = scale
    if not getattr(mcore_optimizer._multi_tensor_copy_this_to_that, "foreach", False):
        fallback = mcore_optimizer._multi_tensor_copy_this_to_that

        def copy(this, that, overflow_buf=None):
            if overflow_buf is None:  # megatron-core's loop (bf16): one foreach copy instead
                return copy_this_to_that(this, that)
            return fallback(this, that, overflow_buf)  # the multi-tensor scale by 1.0 (ours or apex's)

        copy.foreach = True
        mcore_optimizer._multi_tensor_copy_this_to_that = copy


# -- the distributed optimizer's copies -----------------------------------------------------------------

def _param_copies(opt) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The distributed optimizer's (slices of its parameter buffers, main-parameter shards) pairs, as its
    ``_copy_main_params_to_model_params`` walks them."""
    dsts, srcs = [], []
    for shard_main_groups, model_groups in ((opt.shard_fp32_from_float16_groups, opt.model_float16_groups),
                                            (opt.shard_fp32_groups, opt.model_fp32_groups)):
        for shard_main_group, model_group in zip(shard_main_groups, model_groups):
            for shard_main_param, model_param in zip(shard_main_group, model_group):
                world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
                buffer = opt.buffers[gbuf_index].buckets[bucket_id].param_data
                dst = buffer.view(-1)[world_range.start:world_range.end]
                if dst.data_ptr() == shard_main_param.data_ptr() and dst.dtype == shard_main_param.dtype:
                    continue  # an fp32 parameter's shard is a view of the buffer itself: nothing to copy
                dsts.append(dst)
                srcs.append(shard_main_param)
    return dsts, srcs


def _grad_pairs(opt) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The distributed optimizer's (main-parameter shard, its slice of the model's main_grad) pairs."""
    pairs = []
    for model_groups, shard_main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                            (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for model_group, shard_main_group in zip(model_groups, shard_main_groups):
            for model_param, shard_main_param in zip(model_group, shard_main_group):
                param_range = opt._get_model_param_range_map(model_param)["param"]
                pairs.append((shard_main_param, model_param.main_grad.view(-1)[param_range.start:param_range.end]))
    return pairs


def _copy_main_params_to_model_params(self) -> None:
    """The distributed optimizer's copy of its updated shards into the parameter buffers, one foreach copy."""
    if self.is_stub_optimizer:
        return
    if self._foreach_params is None:
        self._foreach_params = _param_copies(self)
    if self._foreach_params[0]:
        torch._foreach_copy_(*self._foreach_params)


def _copy_model_grads_to_main_grads(self) -> None:
    """The distributed optimizer's hand-over of the reduced gradients to its fp32 shards: each shard's gradient
    is its slice of the gradient buffer in fp32 (fp32 buffers: the slice itself; bf16 buffers, with
    --grad-reduce-in-bf16: fp32 copies, made by one foreach copy)."""
    if self.is_stub_optimizer:
        return
    if self._foreach_grads is None:
        self._foreach_grads = _grad_pairs(self)
    pairs = self._foreach_grads
    low = [i for i, (_, grad) in enumerate(pairs) if grad.dtype != torch.float32]
    grads = [grad for _, grad in pairs]
    if low:  # fp32 copies in one new buffer (freed with the gradients, as megatron-core's .float() copies are)
        sizes = [grads[i].numel() for i in low]
        fp32 = torch.empty(sum(sizes), dtype=torch.float32, device=grads[low[0]].device).split(sizes)
        torch._foreach_copy_(fp32, [grads[i] for i in low])
        for i, grad in zip(low, fp32):
            grads[i] = grad
    for (param, _), grad in zip(pairs, grads):
        param.grad = grad


def use_foreach_copies(optimizer) -> int:
    """Give every distributed optimizer in ``optimizer`` (megatron-core's, or its chain) the foreach copies
    above, where it runs the plain path they replace (no FSDP, no precision-aware optimizer, no FP8
    parameters). Returns how many were switched."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer) or inner.is_stub_optimizer:
            continue
        if (inner.ddp_config.use_megatron_fsdp or inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                or inner._get_fp8_params_and_shard_fp32_from_fp8()[0]):
            continue
        inner._foreach_params = inner._foreach_grads = None
        inner._copy_main_params_to_model_params = types.MethodType(_copy_main_params_to_model_params, inner)
        inner._copy_model_grads_to_main_grads = types.MethodType(_copy_model_grads_to_main_grads, inner)
        switched += 1
    return switched
