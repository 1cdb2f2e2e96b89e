"""Hugging Face Llama directory <-> megatron-snip checkpoint (tools/convert_hf_llama.py).

Both directions build the project's own model (``model.llama.build_model``) in one CPU process
at TP=1, PP=1 and go through the project's checkpoint code (megatron-core ``dist_checkpointing``),
so an imported checkpoint loads in any TP x PP x DP layout and any checkpoint exports.

Import never assembles the model: the checkpoint's tensors are the memory-mapped Hugging Face
tensors themselves, or file-backed tensors where they must be assembled (q/k/v interleaving,
vocabulary padding, a dtype change), so RAM holds no part of the model for long. Export loads
the checkpoint into the model and writes the Hugging Face tensors shard by shard.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from megatron_snip.compat.launch import default_to_one_process, free_port
from megatron_snip.fileio import umask, write_text_atomic
from megatron_snip.interop import hf_files
from megatron_snip.interop.checkpoint_args import saved_args
from megatron_snip.interop.convert import (
    export_part,
    hf_names,
    import_part,
    megatron_target,
    part_view,
    zero_padding_rows,
)
from megatron_snip.interop.hf_files import HFFormatError, HFLlamaConfig
from megatron_snip.training.checkpoint_record import CheckpointRecord

if TYPE_CHECKING:
    from megatron_snip.model.config import ModelConfig
    from megatron_snip.training.config import RunConfig

# Files of a Hugging Face directory kept with an imported checkpoint (SAVE/hf_files/) and
# written back on export: the tokenizer and the generation settings.
KEPT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
              "generation_config.json")
HF_FILES_DIR = "hf_files"
SNIP_SIDE_FILE = "megatron_snip.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def checkpoint_args(config: HFLlamaConfig, divisible_by: int, dtype: torch.dtype) -> dict:
    """The shape arguments an imported checkpoint saves (``model.checkpoint_shape`` reads them)."""
    from megatron_snip.model.llama import padded_vocab_size

    rotary = config.rope_theta
    return {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size, "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "seq_length": min(config.max_position_embeddings, 4096),
        "rotary_base": int(rotary) if float(rotary).is_integer() else rotary,
        "norm_epsilon": config.rms_norm_eps,
        "use_rope_scaling": config.rope_scaling_factor is not None,
        "rope_scaling_factor": config.rope_scaling_factor or 8.0,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": padded_vocab_size(config.vocab_size, divisible_by, 1),
        "make_vocab_size_divisible_by": divisible_by,
        "share_embeddings_and_output_weights": config.tie_word_embeddings,
        "bf16": dtype == torch.bfloat16,
        "model_preset": "hf-import",
        "hf_bos_token_id": config.bos_token_id, "hf_eos_token_id": config.eos_token_id,
    }


@contextlib.contextmanager
def single_process(saved: dict):
    """A one-process gloo group and the configuration of a TP=1 PP=1 model of shape ``saved`` (a
    checkpoint's arguments, with its tokenizer)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.arguments import checkpoint_config
    from megatron_snip.compat.device import setup_device
    from megatron_snip.training.setup import initialize_distributed

    config = checkpoint_config(saved, bf16=bool(saved.get("bf16")),
                               tokenizer=(saved.get("tokenizer_type"), saved.get("tokenizer_model")))
    default_to_one_process()
    setup_device()
    initialize_distributed(config.parallel, config.training.seed)
    try:
        yield config
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _build(run: RunConfig):
    from megatron_snip.model.llama import build_model, transformer_config

    config = transformer_config(run.model, run.parallel)
    # Every parameter is then overwritten (an import fills every part or fails; an export loads
    # them all), so the random initialisation would only cost time (a minute at 1.1B on a CPU).
    config.perform_initialization = False
    (model,) = build_model(run.model, run.parallel, config, run.model.vocab_size)  # no virtual stages here
    model.eval()
    return model


@dataclass(frozen=True)
class ConversionSummary:
    source: str
    destination: str
    parameters: int
    seconds: float


def import_hf(load_dir: str, save_dir: str, divisible_by: int = 128, dtype: str = "fp32",
              progress: bool = True) -> ConversionSummary:
    """Convert Hugging Face Llama ``load_dir`` into a checkpoint (iteration 0) in ``save_dir``.

    Raises HFFormatError (a ValueError) naming the file and the fix for a directory that is not
    a Llama, lacks a shard or a tensor, or holds a tensor of the wrong shape.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_snip.training.checkpointing import TRACKER, save_model_checkpoint

    start = time.perf_counter()
    if os.path.exists(os.path.join(save_dir, TRACKER)):
        raise FileExistsError(f"--save-dir {save_dir} already holds a checkpoint; import into a new directory")
    config = hf_files.read_config(load_dir)
    files = hf_files.weight_files(load_dir)  # before any work: a missing shard fails here
    saved = checkpoint_args(config, divisible_by, DTYPES[dtype])
    with single_process(saved) as run:
        # The model only lends its checkpoint structure (keys, shapes, shardings): its parameters
        # are allocated but never written, so they take no memory.
        model = _build(run)
        parts = _parts_by_parameter(load_dir, files, run.model)
        weights = hf_files.MappedWeights(files)
        state = model.sharded_state_dict()
        apply_factories(state)  # linear_fc1 -> its gate and up halves, as the checkpoint stores them
        params = dict(model.named_parameters())
        owners = _parameter_storages(model)
        tensors = [sh for sh in nested_values(state) if isinstance(sh, ShardedTensor)]
        # Assembled tensors live in files (unlinked at once) so that none of the model needs RAM.
        os.makedirs(save_dir, exist_ok=True)
        made = itertools.count()

        def scratch(shape: tuple[int, ...]) -> torch.Tensor:
            return hf_files.file_backed_empty(os.path.join(save_dir, f".import-scratch-{next(made)}"), shape,
                                              DTYPES[dtype])

        for sh in tqdm(tensors, desc="import", disable=not progress, unit="tensor"):
            name, half = owners[sh.data.untyped_storage().data_ptr()], sh.data.storage_offset() > 0
            sh.data = _checkpoint_tensor(params[name], parts[name], weights, run.model,
                                         DTYPES[dtype], ("up" if half else "gate") if "gate" in parts[name] else None,
                                         scratch)
        del model, params  # their (never touched) allocations
        saved["hf_files"] = _keep_files(load_dir, save_dir)
        hf_import = {"source": os.path.abspath(load_dir),
                     "config": json.load(open(os.path.join(load_dir, hf_files.CONFIG)))}
        save_model_checkpoint(save_dir, CheckpointRecord(0, saved, hf_import=hf_import), state)
        n = sum(p.numel() for p in {id(sh.data): sh.data for sh in tensors}.values())
    return ConversionSummary(load_dir, save_dir, n, time.perf_counter() - start)


def _parts_by_parameter(load_dir: str, files: dict[str, str], model: ModelConfig) -> dict[str, dict[str, str]]:
    """Megatron parameter -> {part: Hugging Face tensor}; every tensor of ``files`` must belong to the
    model and every part of the model must be in ``files`` (checked before anything is read)."""
    expected = hf_names(model)
    for name in files:
        try:
            megatron_target(name, model)
        except KeyError:
            raise HFFormatError(f"{files[name]}: tensor {name} is not part of a {model.num_layers}-layer "
                                f"Llama; check that config.json belongs to these weights") from None
    missing = [n for n in expected if n not in files]
    if missing:
        raise HFFormatError(f"{load_dir}: {len(missing)} tensors of the model are in no weight file, e.g. "
                            f"{missing[0]}; the download is incomplete or config.json is for another model")
    parts: dict[str, dict[str, str]] = {}
    for hf_name, (param, part) in expected.items():
        parts.setdefault(param, {})[part] = hf_name
    return parts


def _parameter_storages(model) -> dict[int, str]:
    """Address of each parameter's storage -> the parameter's name (the sharded state dict's
    tensors are the parameters or views of them)."""
    return {p.untyped_storage().data_ptr(): name for name, p in model.named_parameters()}


def _checkpoint_tensor(param: torch.Tensor, parts: dict[str, str], weights: hf_files.MappedWeights,
                       model: ModelConfig, dtype: torch.dtype, half: str | None, scratch) -> torch.Tensor:
    """The checkpoint's tensor for ``param`` (or its ``half``, "gate" or "up", of linear_fc1), from
    the Hugging Face tensors ``parts``: the memory-mapped tensor itself where it is the whole
    tensor in the right dtype (no copy), else assembled (q/k/v interleaving, vocabulary padding
    rows, a dtype conversion) in ``scratch(shape)``, a file-backed tensor of ``dtype``."""
    if half is not None:
        region, parts = part_view(param, half, model), {"all": parts[half]}
    else:
        region = param
    padded = "vocab" in parts and model.vocab_size != param.shape[0]
    if len(parts) == 1 and not padded:
        (part, name), = parts.items()
        tensor = weights.get(name)
        if tuple(tensor.shape) != tuple(region.shape):
            raise HFFormatError(f"{weights.files[name]}: {name} has shape {tuple(tensor.shape)} but config.json "
                                f"implies {tuple(region.shape)}; check that config.json belongs to these weights")
        if tensor.dtype == dtype:
            return tensor
        return scratch(tuple(tensor.shape)).copy_(tensor)
    out = scratch(tuple(region.shape))
    for part, name in parts.items():
        try:
            import_part(out, part, weights.get(name), model, name)
        except ValueError as e:
            raise HFFormatError(f"{weights.files[name]}: {e}; check that config.json belongs to these "
                                f"weights") from None
    if padded:
        zero_padding_rows(out, model)
    return out


def _keep_files(load_dir: str, save_dir: str) -> str | None:
    """Copy the tokenizer and generation files next to the checkpoint; their directory or None."""
    present = [f for f in KEPT_FILES if os.path.isfile(os.path.join(load_dir, f))]
    if not present:
        return None
    dest = os.path.abspath(os.path.join(save_dir, HF_FILES_DIR))
    os.makedirs(dest, exist_ok=True)
    for f in present:
        shutil.copyfile(os.path.join(load_dir, f), os.path.join(dest, f))
    return dest


def _hf_config(model: ModelConfig, saved: dict, dtype: torch.dtype) -> HFLlamaConfig:
    return HFLlamaConfig(
        vocab_size=model.vocab_size, hidden_size=model.hidden_size, intermediate_size=model.ffn_hidden_size,
        num_hidden_layers=model.num_layers, num_attention_heads=model.num_attention_heads,
        num_key_value_heads=model.num_query_groups, max_position_embeddings=model.max_position_embeddings,
        rope_theta=float(model.rotary_base), rms_norm_eps=model.norm_epsilon,
        tie_word_embeddings=bool(model.share_embeddings_and_output_weights),
        rope_scaling_factor=model.rope_scaling_factor if model.use_rope_scaling else None,
        bos_token_id=saved.get("hf_bos_token_id"), eos_token_id=saved.get("hf_eos_token_id"),
        torch_dtype=_DTYPE_NAMES[dtype])


def _tokenizer_files(run: RunConfig) -> dict[str, str]:
    """Destination name -> source path of the tokenizer and generation files this model uses:
    the training run's tokenizer if it is a Hugging Face one, else the files an import kept."""
    files = {}
    kept = run.model.hf_files
    if kept and os.path.isdir(kept):
        files.update({f: os.path.join(kept, f) for f in os.listdir(kept) if f in KEPT_FILES})
    if run.data.tokenizer_type == "HuggingFaceTokenizer" and run.data.tokenizer_model:
        from megatron_snip.data.hf_tokenizer import tokenizer_files

        files.update(tokenizer_files(run.data.tokenizer_model))
    return files


def export_hf(load_dir: str, save_dir: str, dtype: str = "auto", max_shard_bytes: int = 5 * 2**30,
              progress: bool = True) -> ConversionSummary:
    """Write the newest checkpoint in ``load_dir`` as a Hugging Face Llama directory ``save_dir``
    (which must not exist yet; written as ``save_dir.tmp`` and renamed when complete)."""
    from megatron_snip.training.checkpointing import load_checkpoint

    start = time.perf_counter()
    if os.path.exists(save_dir) and os.listdir(save_dir):
        raise FileExistsError(f"--save-dir {save_dir} exists and is not empty; choose a new directory")
    saved, record = saved_args(load_dir)
    masters = _has_fp32_masters(saved, record)
    tmp = save_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights_dir = load_dir
    if masters and saved.get("use_distributed_optimizer"):
        from megatron_snip.interop import dist_masters

        weights_dir = os.path.join(tmp, "fp32_masters")  # removed before the directory is published
        dist_masters.launch(load_dir, weights_dir, saved, free_port())
    # With fp32 masters in the checkpoint, the model is built in fp32 to receive them.
    with single_process({**saved, "bf16": saved.get("bf16") and not masters}) as run:
        model = _build(run)
        if masters and weights_dir == load_dir:
            _load_fp32_masters(load_dir, model)
        else:
            load_checkpoint(weights_dir, model, None, None, load_optim=False, load_rng=False)
        params = dict(model.named_parameters())
        out_dtype = next(model.parameters()).dtype if dtype == "auto" else DTYPES[dtype]
        names = hf_names(run.model)
        tensors = ((n, export_part(params[m], part, run.model).to(out_dtype)) for n, (m, part) in names.items())
        hf_files.write_shards(tqdm(tensors, total=len(names), desc="export", disable=not progress, unit="tensor"),
                              tmp, max_shard_bytes)
        config = _hf_config(run.model, saved, out_dtype)
        copied = _tokenizer_files(run)
        n = sum(p.numel() for p in model.parameters())
    if weights_dir != load_dir:
        shutil.rmtree(weights_dir)
    for name, src in copied.items():
        shutil.copyfile(src, os.path.join(tmp, name))
    write_text_atomic(os.path.join(tmp, hf_files.CONFIG), json.dumps(hf_files.config_json(config, config.torch_dtype),
                                                                     indent=2) + "\n")
    if "generation_config.json" not in copied:
        generation = {k: v for k, v in (("bos_token_id", config.bos_token_id), ("eos_token_id", config.eos_token_id))
                      if v is not None}
        write_text_atomic(os.path.join(tmp, "generation_config.json"), json.dumps(generation, indent=2) + "\n")
    write_text_atomic(os.path.join(tmp, SNIP_SIDE_FILE), json.dumps(_snip_side_file(load_dir, record, saved,
                                                                                    masters, out_dtype),
                                                                    indent=2) + "\n")
    # Shards are created owner-only; the published directory gets the usual modes.
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask())
    if os.path.isdir(save_dir):
        os.rmdir(save_dir)  # empty (checked above)
    os.replace(tmp, save_dir)
    return ConversionSummary(load_dir, save_dir, n, time.perf_counter() - start)


def _has_fp32_masters(saved: dict, record: CheckpointRecord) -> bool:
    """A --bf16 run's checkpoint holds fp32 master weights next to the bf16 model in its optimizer
    state: megatron-core's mixed-precision optimizer per parameter (read here), the distributed
    optimizer in its flat DP-sharded buffers (read by :mod:`dist_masters`). Imports have none."""
    return bool(saved.get("bf16")) and not record.model_only


# Where megatron-core's mixed-precision optimizer saves each parameter's fp32 master
# (Float16OptimizerWithFloat16Params.sharded_state_dict): the model's key under this prefix.
_MASTER_PREFIX = "optimizer.state.fp32_param"


def _load_fp32_masters(load_dir: str, model) -> None:
    """Load the newest checkpoint's fp32 master weights into fp32 ``model``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    from megatron_snip.training.checkpointing import find_latest, iteration_dir

    params = dict(model.named_parameters())
    state = {name: make_sharded_optimizer_tensor(sh, params[name], _MASTER_PREFIX)
             for name, sh in model.sharded_state_dict().items()
             if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and name in params}
    loaded = dist_checkpointing.load(state, iteration_dir(load_dir, find_latest(load_dir)))
    with torch.no_grad():
        for name in state:  # `loaded` also holds the checkpoint's common (non-tensor) state
            params[name].copy_(loaded[name])


def _snip_side_file(load_dir: str, record: CheckpointRecord, saved: dict, masters: bool, dtype: torch.dtype) -> dict:
    """What the Hugging Face format cannot hold: the precision plan and where SNIP's statistics are."""
    stats_dir = os.path.join(os.path.abspath(load_dir), "snip")
    stats = sorted(f for f in os.listdir(stats_dir) if f.endswith(".json")) if os.path.isdir(stats_dir) else []
    if masters:
        what = "the fp32 master weights of the checkpoint's optimizer"
    elif saved.get("bf16"):
        what = "the checkpoint's bf16 model parameters (a bf16 import has no fp32 masters)"
    else:
        what = "the checkpoint's model parameters, the fp32 master weights"
    return {
        "source_checkpoint": os.path.abspath(load_dir),
        "iteration": record.iteration,
        "weights": f"{what}, in {_DTYPE_NAMES[dtype]}; FP8 and FP4 are compute formats of the GEMMs, never stored",
        "precision_plan": record.precision_plan,
        "precision_schedule": record.precision_schedule,
        "snip_statistics": [os.path.join(stats_dir, f) for f in stats],
    }
