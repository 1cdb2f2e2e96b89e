"""Checkpoints with megatron-core ``dist_checkpointing``, written atomically.

Layout (Megatron-LM's)::

    SAVE/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    SAVE/iter_0000100/                        one checkpoint (dist_checkpointing format)

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed when every rank
has finished; the tracker file is replaced (``os.replace``) last. A crash at
any point therefore leaves the previous checkpoint and tracker intact.

What is saved: the model (sharded, so it reloads into another TP/PP layout),
the optimizer, the LR scheduler, the iteration, consumed samples (the data
position), per-rank RNG states, the arguments and any extra state a caller
adds (the precision plan, for instance).
"""

from __future__ import annotations

import logging
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
# The distributed optimizer's format that loads without gathering to one rank;
# it reshards only over data parallelism (see _check_optimizer_layout).
DIST_OPT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the directory and the fix."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def find_latest(root: str) -> int | None:
    """Iteration of the newest complete checkpoint under ``root``, or None if there is none."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = open(tracker).read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} is corrupt: expected an iteration number, found {text[:40]!r}")
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} "
                              f"is missing; restore it or point the tracker at an existing iter_* directory")
    return iteration


def _layout() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def _rng_state() -> ShardedObject:
    """This rank's RNG states as an object sharded over (pp, tp, dp)."""
    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    lay = _layout()
    return ShardedObject(
        "rng_state", state, (lay["pp"], lay["tp"], lay["dp"]),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank()),
        replica_id=0,
    )


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _materialize_optimizer_state(optimizer) -> None:
    """Create Adam's per-parameter state (step, moments) before loading into it.

    The distributed optimizer's load path reads the state it will overwrite,
    which torch's Adam creates lazily at its first step. A step with zero
    gradients, zero LR and zero weight decay creates it without moving a weight.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not hasattr(opt, "data_parallel_group_idx") or inner is None or len(inner.state) > 0:
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


def _restore_adam_steps(optimizer, state: dict) -> None:
    """Set every parameter's Adam ``step`` to the checkpoint's, one tensor per parameter.

    megatron-core's distributed optimizer, when it falls back to torch's Adam
    (no apex / Transformer Engine), keeps the step in its param groups, and its
    DP-reshardable load leaves each parameter with the step of the state it
    loaded into (our placeholder) or one tensor shared by all parameters, which
    torch would increment once per parameter. Either breaks the bias
    correction after a resume.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    # ChainedOptimizer stores a single optimizer's state unnested (see its load_state_dict).
    states = [state] if len(chained) == 1 else [v for _, v in sorted(state.items())]
    for opt, opt_state in zip(chained, states):
        groups = opt_state.get("optimizer", {}).get("param_groups", [])
        steps = {g["step"] for g in groups if "step" in g}
        if not hasattr(opt, "data_parallel_group_idx") or len(steps) != 1:
            continue
        step = float(steps.pop())
        for param_state in opt.optimizer.state.values():
            param_state["step"] = torch.tensor(step, dtype=torch.float32)


def _sharded_state(model, optimizer, scheduler, *, is_loading: bool, with_optim: bool, with_rng: bool) -> dict:
    model_sd = model.sharded_state_dict()
    state = {"model": model_sd}
    if with_optim:
        if is_loading:
            _materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=DIST_OPT_FORMAT)
        state["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_state()
    return state


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, extra: dict) -> str:
    """Write a complete checkpoint of ``iteration`` under ``root``; collective over all ranks.

    ``model`` is the unwrapped megatron-core module of this rank; ``extra`` is
    replicated, JSON-like state (iteration bookkeeping, args, plans).
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(tmp)
    dist.barrier()
    state = _sharded_state(model, optimizer, scheduler, is_loading=False, with_optim=True, with_rng=True)
    state.update(extra)
    state["iteration"] = iteration
    state["layout"] = _layout()
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return final


def load_checkpoint(root: str, model, optimizer, scheduler, *, load_optim: bool = True,
                    load_rng: bool = True) -> dict | None:
    """Load the newest checkpoint under ``root`` into model/optimizer/scheduler.

    Returns the checkpoint's replicated state (iteration, consumed samples,
    args, extra state), or None if ``root`` holds no checkpoint. Optimizer and
    RNG states are skipped when asked, and RNG states also when the parallel
    layout differs from the saved one (they are per rank).
    """
    iteration = find_latest(root)
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} is corrupt or incomplete ({type(e).__name__}: {e}); "
                              f"delete it and point {os.path.join(root, TRACKER)} at an earlier iteration") from e
    if load_optim:
        _check_optimizer_layout(common, optimizer, path)
    load_rng = load_rng and common.get("layout") == _layout()
    state = _sharded_state(model, optimizer, scheduler, is_loading=True, with_optim=load_optim, with_rng=load_rng)
    try:
        loaded = dist_checkpointing.load(state, path)
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {path} ({type(e).__name__}: {e}); if it is damaged, "
                              f"delete it and point {os.path.join(root, TRACKER)} at an earlier iteration") from e
    model.load_state_dict(loaded["model"])
    if load_optim:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(optimizer, loaded["optimizer"])
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    if load_rng:
        _set_rng_state(loaded["rng_state"])
    log.info("loaded checkpoint %s (optimizer: %s, rng: %s)", path, load_optim, load_rng)
    return {k: v for k, v in loaded.items() if k not in ("model", "optimizer", "rng_state")}


def _check_optimizer_layout(common: dict, optimizer, path: str) -> None:
    """The distributed optimizer's state reshards over DP only; other changes need --no-load-optim."""
    saved, now = common.get("layout", {}), _layout()
    is_distributed = hasattr(optimizer, "data_parallel_group_idx")
    if is_distributed and (saved.get("tp") != now["tp"] or saved.get("pp") != now["pp"]):
        raise CheckpointError(
            f"{path} was saved at TP={saved.get('tp')} PP={saved.get('pp')} with the distributed optimizer, whose "
            f"state reshards only over data parallelism; to load the model weights at TP={now['tp']} "
            f"PP={now['pp']} pass --no-load-optim")
