"""torch's Adam state inside megatron-core's optimizers around a checkpoint load (no apex / Transformer Engine).

megatron-core 0.16.1 expects apex's or Transformer Engine's fused Adam, which keeps its step count in the parameter
groups; torch's Adam (what runs without them: every CPU run, and GPUs without either) keeps one per parameter and
creates its state at the first step. Megatron-LM's own load path trips over both there; these functions make a
load of a checkpoint (this program's or Megatron-LM's) give torch's Adam exactly the state that was saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch


def load(optimizer, state: dict, content: Mapping | None) -> None:
    """Load ``state`` (the optimizer's part of a loaded checkpoint, sharded as ``content``, its content metadata
    says) into ``optimizer`` (state created by :func:`materialize` before the sharded state was built), every
    parameter with its own, saved step."""
    _fill_missing_steps(state)
    with torch.no_grad(), fully_reshardable_steps_kept(content):
        optimizer.load_state_dict(state)
    own_steps(optimizer)


def materialize(optimizer) -> None:
    """Create Adam's per-parameter state if it does not exist yet, equal to a fresh one.

    torch's Adam creates its state lazily at the first step, so a checkpoint
    written before any step (``--train-iters 0``, a preemption at start-up)
    would lack it, and the distributed optimizer's load path reads the state it
    overwrites. A step with zero gradients, LR and weight decay creates the
    moments (zeros) without moving a weight; resetting ``step`` to 0 makes the
    state identical to a fresh optimizer's.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None or len(inner.state) > 0:
            continue
        saved = [(g["lr"], g["weight_decay"]) for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for g, (lr, wd) in zip(inner.param_groups, saved):
            g["lr"], g["weight_decay"] = lr, wd
            for p in g["params"]:
                p.grad = None
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.zeros_like(inner.state[p]["step"])


def own_steps(optimizer) -> None:
    """Give every parameter of a distributed optimizer its own, correct Adam ``step`` tensor after a load.

    megatron-core's distributed optimizer keeps the step in its parameter groups (where apex's and Transformer
    Engine's Adam keep it); after a load its parameters hold the step of the state they loaded into, or one tensor
    shared by all, which torch's Adam would increment once per parameter: Adam's bias correction would break.
    The other optimizers keep torch's own per-parameter steps (see :func:`_fill_missing_steps`).
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        steps = {g["step"] for g in getattr(inner, "param_groups", ()) if g.get("step") is not None}
        if hasattr(opt, "data_parallel_group_idx") and len(steps) == 1:
            step = float(steps.pop())
            for param_state in inner.state.values():
                param_state["step"] = torch.tensor(step, dtype=torch.float32)


@contextlib.contextmanager
def fully_reshardable_steps_kept(content: Mapping | None):
    """Around the distributed optimizer's load of a fully_reshardable state: megatron-core 0.16.1 copies every
    per-parameter state torch's Adam keeps, its ``step`` included, from the loaded tensors, which hold none
    (KeyError 'step'; Transformer Engine's and apex's Adam keep no per-parameter step, so Megatron-LM on a GPU
    with either never meets it). Each parameter's step is left out of that copy and kept (megatron-core set it
    from the loaded parameter groups just before; :func:`own_steps` makes it each parameter's own)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if (content or {}).get("distrib_optim_sharding_type") != "fully_reshardable":
        yield
        return
    copy_states = DistributedOptimizer._set_main_param_and_optimizer_states

    def without_step(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            copy_states(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    DistributedOptimizer._set_main_param_and_optimizer_states = without_step
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = copy_states


def _fill_missing_steps(state) -> None:
    """Add ``step = 0`` to Adam states saved without one: megatron-core's regular optimizers drop a step of 0
    when saving (checkpoints of iteration 0), and torch's Adam needs one."""
    if not isinstance(state, dict):
        return
    if "param_groups" in state and isinstance(state.get("state"), dict):
        for param_state in state["state"].values():
            if isinstance(param_state, dict) and "exp_avg" in param_state and "step" not in param_state:
                param_state["step"] = torch.tensor(0.0, dtype=torch.float32)
    for value in state.values():
        _fill_missing_steps(value)
