"""Checkpoints with megatron-core ``dist_checkpointing``, written atomically.

Layout (Megatron-LM's)::

    SAVE/latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    SAVE/iter_0000100/                        one checkpoint (dist_checkpointing format)
    SAVE/iter_0000100/run_config.yaml         the run's resolved flags (--yaml-cfg reads it back)

A checkpoint is written into ``iter_XXXXXXX.tmp`` and renamed when every rank
has finished; the tracker file is replaced (``os.replace``) last. A crash at
any point therefore leaves the previous checkpoint and tracker intact.

Retention (``--save-retain-interval N``, Megatron-LM's rule): once the tracker
names the new checkpoint, rank 0 deletes the one it named before, unless that
iteration is 0 or divisible by N. Only that checkpoint is ever a candidate, only
after a newer complete one replaced it, and it is first renamed to
``iter_XXXXXXX.deleting`` (no longer an ``iter_*`` checkpoint even if the
deletion is cut short; a later deletion finishes it).

What is saved is what Megatron-LM's ``save_checkpoint`` saves, in its layout, so that either program
resumes the other's checkpoints (``training/megatron_lm_checkpoint.py``): the model (sharded, so it reloads
into another TP/PP layout), the optimizer (in the format its content metadata names), the LR scheduler
(in samples), the iteration, consumed samples (the data position), the RNG states, Megatron-LM's ``args``;
beside them this program's record (flags, precision plan, ...) and its per-rank quantization state.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException

from megatron_snip.compat.device import current_device
from megatron_snip.fileio import write_text_atomic
from megatron_snip.training import adam_state, save_helper
from megatron_snip.training import megatron_lm_checkpoint as megatron_lm
from megatron_snip.training.checkpoint_match import drop_absent_extra_states, mismatch, saved_keys
from megatron_snip.training.checkpoint_record import SAVED_BY_US, CheckpointRecord

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the directory and the fix."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _save_strategy(fully_parallel: bool):
    """megatron-core's torch_dist writer; fully parallel: the shards that data-parallel ranks hold alike
    are written by different ranks (Megatron-LM's --ckpt-fully-parallel-save, its default)."""
    if not fully_parallel:
        return None  # dist_checkpointing's default: each shard from the rank with replica_id 0
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy(),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def _load_strategy(path: str, fully_parallel: bool):
    """megatron-core's reader for ``path``; fully parallel: each data-parallel rank reads part of the
    shards and they exchange them (Megatron-LM's --ckpt-fully-parallel-load)."""
    if not fully_parallel:
        return None
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    return FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def find_latest(root: str) -> int | None:
    """Iteration of the newest complete checkpoint under ``root``, or None if there is none."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None
    iteration = _read_tracker(tracker)
    if not os.path.isdir(iteration_dir(root, iteration)):
        raise CheckpointError(f"{tracker} names iteration {iteration} but {iteration_dir(root, iteration)} "
                              f"is missing; restore it or point the tracker at an existing iter_* directory")
    return iteration


def _read_tracker(tracker: str) -> int:
    """The iteration a tracker file names; CheckpointError for anything else, Megatron-LM's "release" said as such."""
    text = open(tracker).read().strip()
    if text == "release":
        release = os.path.join(os.path.dirname(tracker), "release")
        raise CheckpointError(f"{tracker} names Megatron-LM's release checkpoint {release} (weights to fine-tune "
                              f"from), which this program reads as an iter_* checkpoint: rename {release} to "
                              f"{iteration_dir(os.path.dirname(tracker), 0)}, write 0 into {tracker} and pass "
                              f"--finetune, as Megatron-LM loads a release checkpoint")
    try:
        return int(text)
    except ValueError:
        raise CheckpointError(f"{tracker} is corrupt: expected an iteration number, found {text[:40]!r}") from None


def other_format(path: str) -> str | None:
    """What checkpoint ``path`` is when it is one of Megatron-LM's formats other than torch_dist (not damaged:
    another format), with how to convert it; None otherwise."""
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    convert = ("convert it with Megatron-LM (its --ckpt-convert-format torch_dist --ckpt-convert-save DIR) and "
               "--load the converted one")
    if any(name.startswith("mp_rank_") for name in names):
        return (f"{path} is a checkpoint in Megatron-LM's torch format (mp_rank_* files), which this program "
                f"does not read (only torch_dist); {convert}")
    if ".metadata" in names and "metadata.json" not in names and "common.pt" not in names:
        return (f"{path} is a checkpoint in Megatron-LM's torch_dcp or fsdp_dtensor format, which this program "
                f"does not read (only torch_dist); {convert}")
    return None


def newer_non_persistent(root: str, iteration: int) -> str | None:
    """Where Megatron-LM would resume a newer checkpoint than ``iteration`` from ``root``: its non-persistent
    checkpoints (--non-persistent-save-interval, ``root/non_persistent``), which it prefers when newer; a notice."""
    tracker = os.path.join(root, "non_persistent", TRACKER)
    try:
        newer = _read_tracker(tracker) if os.path.isfile(tracker) else None
    except CheckpointError:
        return None
    if newer is None or newer <= iteration:
        return None
    where = os.path.dirname(tracker)
    return (f"{where} holds a newer checkpoint (iteration {newer}) than the one loaded ({iteration}), a "
            f"non-persistent one that Megatron-LM would resume instead; to resume it, --load {where}")


# Files every complete dist_checkpointing checkpoint holds.
_REQUIRED_FILES = ("metadata.json", ".metadata", "common.pt")
_ITERATION_DIR = re.compile(r"iter_(\d{7})")
DAMAGED_SUFFIX = ".damaged"  # a damaged checkpoint set aside by --ckpt-fallback (no longer an iter_* checkpoint)


def damage(path: str) -> str | None:
    """What is wrong with the files of checkpoint ``path``, naming the file; None if they are all there,
    as long as its index (``.metadata``) says, and ``common.pt`` loads. (A shard of the right size with
    wrong bytes is found only when it is loaded.)"""
    if not os.path.isdir(path):
        return f"{path} is missing"
    for name in _REQUIRED_FILES:
        if not os.path.isfile(os.path.join(path, name)):
            return f"{os.path.join(path, name)} is missing"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # unpickling a damaged index raises anything
        return f"{os.path.join(path, '.metadata')} cannot be read ({type(e).__name__}: {str(e)[:200]})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{file} is missing"
        if os.path.getsize(file) < size:
            return f"{file} has {os.path.getsize(file)} bytes but the index needs {size} (truncated)"
    try:
        dist_checkpointing.load_common_state_dict(path)
    except _READ_ERRORS as e:
        return f"{os.path.join(path, 'common.pt')} cannot be read ({_first_error(e)})"
    return None


def verify_latest(root: str) -> int | None:
    """Like :func:`find_latest`, and check the checkpoint's files (:func:`damage`)."""
    return choose_checkpoint(root, fallback=False)[0]


def choose_checkpoint(root: str, fallback: bool) -> tuple[int | None, str | None]:
    """The iteration to load from ``root`` (None: no checkpoint) and, when it is not the tracker's, the
    start-up notice saying why: the tracker's checkpoint if its files are intact; if not, with ``fallback``
    (--ckpt-fallback) the newest intact earlier one, else CheckpointError naming the damaged file."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        return None, None
    newest = _read_tracker(tracker)
    path = iteration_dir(root, newest)
    foreign = other_format(path)
    if foreign is not None:
        raise CheckpointError(f"{foreign} (it is not damaged)")
    broken = damage(path)
    if broken is None:
        return newest, None
    intact = next((it for it in _iterations(root) if it < newest and damage(iteration_dir(root, it)) is None), None)
    if not fallback:
        instead = (f"pass --ckpt-fallback to load the newest intact one, {iteration_dir(root, intact)}, instead"
                   if intact is not None else "no earlier checkpoint here is intact")
        raise CheckpointError(f"checkpoint {path}, the one {tracker} names, is damaged: {broken}; {instead}, or "
                              f"restore the file")
    if intact is None:
        raise CheckpointError(f"--ckpt-fallback: checkpoint {path} is damaged ({broken}) and no earlier checkpoint "
                              f"in {root} is intact")
    return intact, (f"--ckpt-fallback: checkpoint {path} is damaged ({broken}); loading "
                    f"{iteration_dir(root, intact)}, the newest intact one")


def _iterations(root: str) -> list[int]:
    """The iterations of the ``iter_N`` directories under ``root``, newest first."""
    found = (_ITERATION_DIR.fullmatch(name) for name in os.listdir(root))
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def set_aside(root: str, iteration: int) -> str | None:
    """On one rank, before training: make ``iteration`` (the one --ckpt-fallback loads) the newest checkpoint
    under ``root`` again: the damaged newer one the tracker names is renamed ``iter_N.damaged`` (kept, never
    overwritten by this run's save of that iteration) and the tracker names ``iteration``. Returns what was
    done, or None if the tracker already names ``iteration``."""
    newest = _read_tracker(os.path.join(root, TRACKER))
    if newest == iteration:
        return None
    damaged = iteration_dir(root, newest)
    aside, n = damaged + DAMAGED_SUFFIX, 1
    while os.path.exists(aside):
        n += 1
        aside = f"{damaged}{DAMAGED_SUFFIX}.{n}"
    if os.path.isdir(damaged):
        os.replace(damaged, aside)
    write_text_atomic(os.path.join(root, TRACKER), str(iteration))
    return f"set the damaged {damaged} aside as {aside}; {os.path.join(root, TRACKER)} names {iteration} again"


def remove_partial_saves(root: str) -> list[str]:
    """On one rank, before training: delete the ``iter_N.tmp`` folders interrupted saves left under ``root``
    (a save writes there and renames it when complete; the tracker never named one). Returns them."""
    if not os.path.isdir(root):
        return []
    partial = sorted(os.path.join(root, name) for name in os.listdir(root)
                     if name.endswith(".tmp") and _ITERATION_DIR.fullmatch(name.removesuffix(".tmp")))
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial


def tidy(save: str | None, load: str | None, load_iteration: int | None) -> list[str]:
    """On rank 0 before any rank reads or writes a checkpoint: remove the partial saves under ``save`` and,
    where --ckpt-fallback loads an earlier checkpoint of the folder it saves to, set the damaged one aside
    (:func:`set_aside`). Returns one line per action, for the start-up log."""
    lines = [f"removed {path}: a partial checkpoint an interrupted save left (the tracker never named it)"
             for path in (remove_partial_saves(save) if save else [])]
    if load is not None and load_iteration is not None and os.path.abspath(load) == os.path.abspath(save or ""):
        done = set_aside(load, load_iteration)
        if done:
            lines.append(f"--ckpt-fallback: {done}")
    return lines


def read_record(root: str, iteration: int | None = None) -> CheckpointRecord | None:
    """The record of checkpoint ``iteration`` under ``root`` (default: the newest, checked with
    :func:`verify_latest`): iteration, arguments, precision plan and schedule, ... without loading any
    tensor; None if ``root`` holds no checkpoint. Needs no process group (argument validation reads it
    before start-up)."""
    if iteration is None:
        iteration = verify_latest(root)
    if iteration is None:
        return None
    return _read_record(root, iteration_dir(root, iteration))


def _read_record(root: str, path: str) -> CheckpointRecord:
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except (ModuleNotFoundError, AttributeError) as e:  # pickled with a class this installation lacks
        raise CheckpointError(f"cannot read {os.path.join(path, 'common.pt')}: it was pickled with {e} (a module "
                              f"or class of the program that saved it, not installed here); the checkpoint is "
                              f"not damaged: install that package, or save the checkpoint without it") from e
    except _READ_ERRORS as e:
        raise _damaged(root, os.path.join(path, "common.pt"), e) from e
    try:
        return megatron_lm.read_common(common, path)
    except megatron_lm.CannotLoad:
        raise
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def _layout() -> dict:
    """This run's parallel sizes as a checkpoint records them (``dp`` without context parallelism, as
    Megatron-LM's data_parallel_size)."""
    layout = {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
        "cp": parallel_state.get_context_parallel_world_size(),
    }
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:  # absent without interleaving, as in checkpoints written before it existed
        layout["vpp"] = vpp
    return layout


def _chunks(model) -> list:
    """A model given as one module or as its list of chunks (virtual pipeline stages)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _model_keys(chunks: list) -> list[str]:
    """State keys of the chunks' weights: "model", or Megatron-LM's "model0", "model1", ... with
    virtual stages. Only the structure differs: the tensors' global keys make a checkpoint load
    into any TP / PP / virtual-stage layout."""
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _legacy_rng_state() -> ShardedObject:
    """The RNG and quantization states as checkpoints before record version 2 held them: one object per
    (pp, tp, dp) rank (loaded only into the same layout)."""
    lay = _layout()
    template = {"quantization": {}, "random": None, "np": None, "torch": None, "cuda": None, "tracker": None}
    return ShardedObject(
        "rng_state", template, (lay["pp"], lay["tp"], lay["dp"]),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
         parallel_state.get_data_parallel_rank(with_context_parallel=True)),
        replica_id=0,
    )


def _set_legacy_rng_state(state: dict) -> None:
    megatron_lm.set_rng({"random_rng_state": state["random"], "np_rng_state": state["np"],
                         "torch_rng_state": state["torch"], "cuda_rng_state": state["cuda"],
                         "rng_tracker_states": state["tracker"]})


def _metadata(content: Mapping | None) -> dict:
    """What sharded_state_dict is given: a checkpoint's content metadata and, as in Megatron-LM, the data-parallel
    group with context parallelism (the replicas of every shard)."""
    return {**(content or {}), "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _sharded_state(model, optimizer, *, is_loading: bool, with_optim: bool, metadata: dict) -> dict:
    """The model chunks' and (``with_optim``) the optimizer's sharded state, keyed as Megatron-LM keys them."""
    chunks = _chunks(model)
    model_sd = {key: chunk.sharded_state_dict(metadata=metadata) for key, chunk in zip(_model_keys(chunks), chunks)}
    state = dict(model_sd)
    if with_optim:
        adam_state.materialize(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=metadata)
    return state


def save_checkpoint(root: str, record: CheckpointRecord, model, optimizer, scheduler,
                    quantization: dict | None = None, *, save_optim: bool = True, save_rng: bool = True,
                    files: Mapping[str, str] | None = None, fully_parallel: bool = True,
                    retain_interval: int | None = None, fully_reshardable: bool = False) -> str:
    """Write a complete checkpoint of ``record.iteration`` under ``root``; collective over all ranks.

    ``model`` is this rank's unwrapped megatron-core module, or its list of chunks; ``record`` is the
    replicated state (iteration bookkeeping, args, plans; its layout, scheduler state, optimizer format and
    save flags are filled in here); ``quantization`` is this rank's module quantization state.
    ``save_optim=False`` / ``save_rng=False`` (``--no-save-optim`` / ``--no-save-rng``) leave out the
    optimizer and scheduler / RNG and quantization states; loading such a checkpoint skips them.
    ``files``: text files (name -> content) written into the checkpoint's directory with it, such as
    the run's resolved configuration. ``fully_parallel``: spread the writes over data-parallel ranks.
    ``retain_interval``: delete the checkpoint this one replaces as the newest unless its iteration is
    0 or a multiple (see the module docstring); None keeps every checkpoint. ``fully_reshardable``: the
    distributed optimizer's state in Megatron-LM's fully_reshardable format (--dist-ckpt-optim-fully-reshardable:
    it loads into any TP / PP), else dp_reshardable.
    """
    check_finite(model, optimizer, iteration_dir(root, record.iteration))
    content = megatron_lm.content_metadata(_is_distributed(optimizer), fully_reshardable)
    state = _sharded_state(model, optimizer, is_loading=False, with_optim=save_optim, metadata=_metadata(content))
    if save_rng:
        state[megatron_lm.RNG_KEY] = megatron_lm.rng_object()
        state[megatron_lm.QUANTIZATION_KEY] = megatron_lm.quantization_object(quantization)
    record = replace(record, no_optimizer_state=not save_optim, no_rng_state=not save_rng,
                     scheduler=scheduler.state_dict() if save_optim else None, content_metadata=content)
    return _write(root, record, state, files, _save_strategy(fully_parallel), retain_interval)


def _is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is megatron-core's distributed optimizer (state sharded over the dp-cp group)."""
    return any(hasattr(opt, "data_parallel_group_idx") for opt in getattr(optimizer, "chained_optimizers",
                                                                           [optimizer]))


def save_model_checkpoint(root: str, record: CheckpointRecord, model_state: dict) -> str:
    """Write a checkpoint of model weights only (an imported model), given as this rank's sharded
    state dict of the model; collective. Loading it skips the optimizer and RNG states, as
    ``--finetune`` does, whatever the flags say."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path = iteration_dir(root, record.iteration)
    bad = [sh.key for sh in nested_values(model_state) if isinstance(sh, ShardedTensor)
           and not bool(torch.isfinite(sh.data).all())]
    flag = torch.tensor([float(bool(bad))], device=current_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank raises, none waits in the save
    if flag.item():
        raise CheckpointError(f"refusing to save {path}: non-finite values in "
                              f"{', '.join(sorted(set(bad))[:5]) or 'another rank'}")
    return _write(root, replace(record, model_only=True, content_metadata=megatron_lm.content_metadata(False)),
                  {"model": model_state})


def _write(root: str, record: CheckpointRecord, state: dict, files: Mapping[str, str] | None = None,
           strategy=None, retain_interval: int | None = None) -> str:
    """Save ``state`` + ``record`` (and the text ``files``) as ``root/iter_<iteration, 7 digits>`` atomically
    with the sharded ``strategy`` (None: dist_checkpointing's default), then apply retention (see the
    module docstring)."""
    iteration = record.iteration
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"

    def prepare() -> None:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        os.makedirs(tmp)

    def publish() -> None:
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        replaced = _tracked_iteration(root)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomic(os.path.join(root, TRACKER), str(iteration))
        if retain_interval is not None:
            retire(root, replaced, iteration, retain_interval)

    _on_rank_0(prepare, root, final)
    record = replace(record, layout=_layout())
    state.update(megatron_lm.common_state(record))
    save_helper.install()  # before the writer spawns its own helper, which a SIGTERM would kill
    try:
        dist_checkpointing.save(state, tmp, sharded_strategy=strategy,
                                content_metadata=dict(record.content_metadata or {}) or None)
    except _READ_ERRORS as e:  # a failed write (full disk, quota) raises on every rank, after all wrote
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # give a full disk its space back
        raise CheckpointError(f"cannot save checkpoint {final} ({_first_error(e)}); nothing was renamed: the "
                              f"newest complete checkpoint is still the one {os.path.join(root, TRACKER)} "
                              f"names; free space under {root} or point --save elsewhere") from e
    dist.barrier()
    _on_rank_0(publish, root, final)
    return final


def _on_rank_0(action, root: str, final: str) -> None:
    """Run ``action`` (file operations of the save of ``final``) on rank 0; collective: if it fails (a full
    disk, a revoked mount) every rank raises the same CheckpointError, where otherwise the others would wait
    in the next collective for a rank that is gone."""
    error = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as e:
            error = (f"cannot save checkpoint {final} ({type(e).__name__}: {e}); the newest complete checkpoint is "
                     f"still the one {os.path.join(root, TRACKER)} names; make {root} writable (or free space) "
                     f"and resume, or point --save elsewhere")
    flag = torch.tensor([float(error is not None)], device=current_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        message = [error]
        dist.broadcast_object_list(message, src=0)
        raise CheckpointError(message[0])


def _tracked_iteration(root: str) -> int | None:
    """The iteration the tracker names now (None: none, or unreadable: then nothing is retired)."""
    try:
        return find_latest(root)
    except CheckpointError:
        return None


def retire(root: str, replaced: int | None, newest: int, retain_interval: int) -> str | None:
    """Megatron-LM's --save-retain-interval on rank 0, after the tracker names ``newest``: delete the
    checkpoint ``replaced`` (the one the tracker named before) unless it is 0, divisible by
    ``retain_interval``, or not older than ``newest`` (a directory that already held later checkpoints
    keeps them). Returns the deleted directory, if any."""
    if replaced is None or replaced == 0 or replaced >= newest or replaced % retain_interval == 0:
        return None
    path = iteration_dir(root, replaced)
    if os.path.islink(path) or not os.path.isdir(path):  # Megatron-LM leaves links alone too
        return None
    for cut_short in glob.glob(os.path.join(root, "iter_*.deleting")):
        shutil.rmtree(cut_short, ignore_errors=True)
    doomed = path + ".deleting"
    os.replace(path, doomed)  # no longer a checkpoint, whatever happens below
    shutil.rmtree(doomed)
    log.info("deleted checkpoint %s (--save-retain-interval %d)", path, retain_interval)
    return path


def _optimizer_tensors(optimizer):
    """The optimizer's own fp32 copies of the weights (mixed precision) and its state tensors."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            yield from group["params"]
        for param_state in inner.state.values():
            yield from (v for v in param_state.values() if torch.is_tensor(v) and v.is_floating_point())


def check_finite(model, optimizer, path: str) -> None:
    """Collective: raise CheckpointError on every rank if any rank's weights (``model``: a module or
    its list of chunks) or optimizer state (None: none) hold
    a NaN or Inf, before anything is written (a checkpoint must never persist non-finite state)."""
    from megatron_snip.model.parameter_names import global_parameter_names
    from megatron_snip.training.safety import gather_culprits

    bad = [name for p, name in global_parameter_names(_chunks(model)).items()
           if not bool(torch.isfinite(p.detach()).all())]
    if not bad and optimizer is not None and any(not bool(torch.isfinite(t.detach()).all())
                                                 for t in _optimizer_tensors(optimizer)):
        bad = ["optimizer state"]
    flag = torch.tensor([float(bool(bad))], device=current_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(f"refusing to save {path}: non-finite values in {gather_culprits(bad)}; the previous "
                              f"checkpoint stays the newest; non-finite values reach the weights only when "
                              f"--no-check-for-nan-in-loss-and-grad is given: drop it")


# torch.distributed.checkpoint reports failed reads as a BaseException subclass.
_READ_ERRORS = (Exception, CheckpointException)


def _first_error(error: BaseException) -> str:
    """"Type: first line" of what broke. A CheckpointException wraps the per-rank errors (each as an
    (exception, traceback) pair) on the coordinating rank and none on the others; the first one
    says what broke, and the cause chain what a worker process raised."""
    failures = getattr(error, "failures", None)
    if failures == {}:
        return "a shard write failed; rank 0's error names the cause"
    error = next(iter((failures or {}).values()), error)
    if isinstance(error, tuple):
        error = error[0]
    while error.__cause__ is not None:  # megatron-core wraps a writer's OSError in a RuntimeError
        error = error.__cause__
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    return f"{type(error).__name__}: {first_line}"


def _damaged(root: str, path: str, error: BaseException) -> CheckpointError:
    return CheckpointError(f"cannot load checkpoint {path} ({_first_error(error)}); if it is damaged, "
                           f"delete it and point {os.path.join(root, TRACKER)} at an earlier iteration")


def load_checkpoint(root: str, model, optimizer, scheduler, *, load_optim: bool = True,
                    load_rng: bool = True, fully_parallel: bool = False, iteration: int | None = None,
                    run_args: Mapping | None = None) -> Loaded | None:
    """Load the newest checkpoint under ``root`` (or that of ``iteration``: --ckpt-fallback's choice) into
    model/optimizer/scheduler, as Megatron-LM's load_checkpoint does.

    Returns the checkpoint's record and this rank's saved module quantization state ({} when not
    loaded), or None if ``root`` holds no checkpoint. Optimizer and RNG states are skipped when asked. The RNG
    state loads where the tensor- and pipeline-parallel sizes are the saved ones (it is replicated over
    data-parallel ranks, as in Megatron-LM), the quantization state only into the saved layout (it is per rank).
    ``fully_parallel``: spread the reads over data-parallel ranks. ``run_args``: this run's flags, to name the
    ones that differ when the checkpoint holds a model of another shape.
    """
    if iteration is None:
        iteration = find_latest(root)
    if iteration is None:
        return None
    path = iteration_dir(root, iteration)
    record = _read_record(root, path)
    load_optim = load_optim and not (record.model_only or record.no_optimizer_state)
    load_rng = load_rng and not (record.model_only or record.no_rng_state)
    if load_optim:
        _check_optimizer_layout(record, optimizer, path, fully_parallel)
    saved, now = dict(record.layout), _layout()
    same_layout = {**saved, "cp": saved.get("cp", 1)} == now
    if record.legacy:
        load_rng = load_rng and same_layout
        load_quantization = False
    else:
        load_rng = load_rng and (saved.get("tp"), saved.get("pp")) == (now["tp"], now["pp"])
        load_quantization = load_rng and same_layout and record.saved_by == SAVED_BY_US
    state = _sharded_state(model, optimizer, is_loading=True, with_optim=load_optim,
                           metadata=_metadata(record.content_metadata))
    if load_rng:
        state[megatron_lm.RNG_KEY] = _legacy_rng_state() if record.legacy else megatron_lm.rng_object()
    if load_quantization:
        state[megatron_lm.QUANTIZATION_KEY] = megatron_lm.quantization_object()
    held = saved_keys(path)
    chunks = _chunks(model)
    absent = {key: drop_absent_extra_states(state[key], held) for key in _model_keys(chunks)}
    problem = mismatch(state, path, record, run_args, held)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        with warnings.catch_warnings():
            # megatron-core 0.16 calls torch APIs that torch marks deprecated; nothing for a user to do.
            warnings.simplefilter("ignore", FutureWarning)
            loaded = dist_checkpointing.load(state, path, sharded_strategy=_load_strategy(path, fully_parallel))
    except _READ_ERRORS as e:
        raise _damaged(root, path, e) from e
    for key, chunk in zip(_model_keys(chunks), chunks):
        chunk.load_state_dict({**loaded[key], **dict.fromkeys(absent[key])})
    if not load_optim and optimizer is not None:
        # The mixed-precision optimizers copied their fp32 masters from the model when they were
        # built; the first step would write those initial weights back over the loaded ones
        # (--finetune, --no-load-optim, model-only checkpoints). Megatron-LM's reload_model_params.
        optimizer.reload_model_params()
    if load_optim:
        adam_state.load(optimizer, loaded["optimizer"], record.content_metadata)
        if record.scheduler is not None:
            scheduler.load_state_dict(dict(record.scheduler))
    quantization = {}
    if load_rng and record.legacy:
        _set_legacy_rng_state(loaded[megatron_lm.RNG_KEY])
        quantization = loaded[megatron_lm.RNG_KEY].get("quantization", {})  # absent in the oldest
    elif load_rng:
        megatron_lm.set_rng(megatron_lm.pick_rng(loaded[megatron_lm.RNG_KEY]))
        quantization = loaded.get(megatron_lm.QUANTIZATION_KEY, {}) if load_quantization else {}
    log.info("loaded checkpoint %s (optimizer: %s, rng: %s, quantization state: %s)", path, load_optim, load_rng,
             bool(quantization))
    return Loaded(record, quantization, load_optim, load_rng)


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_checkpoint` read besides the tensors it loaded in place."""

    record: CheckpointRecord
    quantization: dict  # this rank's module quantization state (RNG streams, delayed-scaling history)
    optimizer: bool = False  # whether the optimizer and scheduler states were loaded
    rng: bool = False  # whether the RNG states were loaded


def _check_optimizer_layout(record: CheckpointRecord, optimizer, path: str, fully_parallel: bool) -> None:
    """The optimizer's saved state against this run's: the same kind (distributed or not), and a distributed
    optimizer's dp_reshardable state only into the saved TP / PP / virtual stages (it reshards over the
    data-parallel ranks with context parallelism: DP and CP may change); other changes need --no-load-optim."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    sharding = (record.content_metadata or {}).get("distrib_optim_sharding_type")
    # Before record version 2 every optimizer was given the distributed optimizer's format name.
    saved_distributed = bool(record.args.get("use_distributed_optimizer")) if record.legacy else sharding is not None
    distributed = _is_distributed(optimizer)
    if saved_distributed != distributed:
        saved_with = "with" if saved_distributed else "without"
        raise CheckpointError(
            f"{path} holds the optimizer state of a run {saved_with} --use-distributed-optimizer, which this run's "
            f"optimizer cannot read; run {saved_with} --use-distributed-optimizer as it was saved, or pass "
            f"--no-load-optim to load the model weights only")
    if fully_parallel and sharding == "dp_zero_gather_scatter":
        raise CheckpointError(f"{path} holds the distributed optimizer's state in Megatron-LM's older "
                              f"dp_zero_gather_scatter format, which megatron-core loads only on one rank: drop "
                              f"--ckpt-fully-parallel-load")
    saved, now = record.layout, _layout()
    if not distributed or sharding in DistributedOptimizer.checkpoint_fully_reshardable_formats:
        return
    if any(saved.get(k) != now.get(k) for k in ("tp", "pp", "vpp")):
        def name(layout: Mapping) -> str:
            vpp = f" VPP={layout['vpp']}" if layout.get("vpp") else ""
            return f"TP={layout.get('tp')} PP={layout.get('pp')}{vpp}"
        raise CheckpointError(
            f"{path} was saved at {name(saved)} with the distributed optimizer in its {sharding} format, which "
            f"reshards only over data-parallel (and context-parallel) ranks; to load the model weights at "
            f"{name(now)} pass --no-load-optim (a checkpoint saved with --dist-ckpt-optim-fully-reshardable "
            f"loads at any TP and PP)")

