"""What a checkpoint holds against what a run asks of it, compared before anything is loaded.

``dist_checkpointing.load`` stops at the first tensor whose shape differs ("Global shape mismatch") or
that the checkpoint lacks ("Missing key"), which reads like damage. Compared here first, from the
checkpoint's index, a difference is said for what it is: a model of another shape (naming the flags
that differ), or a state saved in another format or layout (naming the flag that skips it); the files
are not damaged.
"""

from __future__ import annotations

from collections.abc import Mapping

from megatron_snip.model import checkpoint_shape
from megatron_snip.training.checkpoint_record import CheckpointRecord

EXTRA_STATE = "_extra_state"  # a module's non-tensor state in PyTorch's state dict (Transformer Engine's FP8 metadata)

# What each top-level entry of the state is, and the flag that leaves it out of the load.
_PARTS = {"optimizer": ("the optimizer state", "--no-load-optim"),
          "rng_state": ("the RNG state", "--no-load-rng")}


def saved_keys(path: str) -> Mapping:
    """The keys checkpoint ``path`` holds (its index's), each with its metadata (a tensor's size)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path).read_metadata().state_dict_metadata


def drop_absent_extra_states(model_state: dict, saved: Mapping) -> list[str]:
    """Remove from ``model_state`` (a model chunk's sharded state dict) the ``_extra_state`` objects the
    checkpoint (``saved``: :func:`saved_keys`) does not hold, and return their names; the caller gives them
    None before ``load_state_dict``. The final norm asks for one (model/norms.py, TEExtraState) that older
    checkpoints of this program and those of Megatron-LM without Transformer Engine lack; no extra state
    carries anything a module here uses."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    absent = [name for name, item in model_state.items()
              if name.endswith(EXTRA_STATE) and isinstance(item, ShardedObject) and item.unique_key not in saved]
    for name in absent:
        del model_state[name]
    return absent


def mismatch(state: dict, path: str, record: CheckpointRecord, run_args: Mapping | None = None,
             saved: Mapping | None = None) -> str | None:
    """A one-line description of what in ``state`` (the sharded state a load would request) checkpoint ``path``
    does not hold in the requested shape, or None when everything is there. ``run_args``: the run's flags,
    compared with ``record.args`` to name the flags behind a model of another shape. ``saved``: the
    checkpoint's keys (:func:`saved_keys`), read from ``path`` when not given."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    saved = saved_keys(path) if saved is None else saved
    for part, sub in state.items():
        prepared, _, _ = load_preprocess({part: sub})  # the tensors factories make (a copy)
        for item in nested_values(prepared):
            if isinstance(item, ShardedTensor):
                meta = saved.get(item.key)
                if meta is None:
                    return _say(part, path, record, run_args, f"holds no {item.key}")
                if tuple(meta.size) != tuple(item.global_shape) and not item.allow_shape_mismatch:
                    return _say(part, path, record, run_args, f"holds {item.key} of shape {tuple(meta.size)} "
                                f"where this run's is {tuple(item.global_shape)}")
            elif isinstance(item, ShardedObject) and item.unique_key not in saved:
                return _say(part, path, record, run_args, f"holds no {item.unique_key}")
    return None


def _say(part: str, path: str, record: CheckpointRecord, run_args: Mapping | None, what: str) -> str:
    if part in _PARTS:
        name, flag = _PARTS[part]
        return (f"checkpoint {path} {what}: {name} was saved in another format or parallel layout than this run "
                f"reads (saved by {record.saved_by}); the checkpoint is not damaged; pass {flag} to load without it")
    differ = checkpoint_shape.differences(record.args, run_args or {})
    why = (f"it was saved with {', '.join(differ)}" if differ
           else "its saved flags do not say why; compare them with this run's")
    return (f"checkpoint {path} {what}: it holds a model of another shape than this run builds ({why}); the "
            f"checkpoint is not damaged: run with its shape (drop the flags that differ, the checkpoint gives "
            f"them), or train into another --save")
