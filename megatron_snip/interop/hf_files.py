"""Reading and writing Hugging Face model directories: ``config.json`` and safetensors shards.

Only what a Llama conversion needs: the architecture fields of ``config.json`` as a
:class:`HFLlamaConfig`, the weight files a directory names (``model.safetensors`` or a
``model.safetensors.index.json`` with its shards), and
shards written with an index, each file atomically (temporary name, fsync, rename).
Tensors are read memory-mapped, one tensor per mapping (:class:`MappedWeights`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch

from megatron_snip.fileio import write_text_atomic

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# The rope scaling megatron-core implements (RotaryEmbedding._apply_scaling): Llama 3.1's
# "llama3" type with these fixed constants; only the factor varies.
LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFFormatError(ValueError):
    """A Hugging Face directory this converter cannot read; the message names the file and the fix."""


@dataclass(frozen=True)
class HFLlamaConfig:
    """The fields of a ``LlamaForCausalLM`` config.json that define the model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    rope_scaling_factor: float | None  # Llama 3.1/3.2 "llama3" rope scaling; None: none
    bos_token_id: int | list | None
    eos_token_id: int | list | None
    torch_dtype: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _rope(raw: dict, path: str) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None) from a transformers 4.x config (``rope_theta``,
    ``rope_scaling``) or a 5.x one (``rope_parameters``)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    constants = {k: scaling.get(k) for k in LLAMA3_ROPE_CONSTANTS}
    if kind != "llama3" or any(float(v or -1) != LLAMA3_ROPE_CONSTANTS[k] for k, v in constants.items()):
        raise HFFormatError(f"{path}: rope scaling {scaling} is not supported; megatron-core implements only "
                            f"Llama 3.1's 'llama3' type with {LLAMA3_ROPE_CONSTANTS} (Llama 3.1 / 3.2 checkpoints)")
    return float(theta), float(scaling["factor"])


def read_config(hf_dir: str) -> HFLlamaConfig:
    """The Llama architecture of ``hf_dir/config.json``; refuses other architectures and options
    the megatron-core Llama does not have (biases, other activations, a custom head_dim)."""
    path = os.path.join(hf_dir, CONFIG)
    if not os.path.isfile(path):
        raise HFFormatError(f"--load-dir {hf_dir}: no {CONFIG}; give a Hugging Face model directory "
                            f"(save_pretrained output or a downloaded snapshot)")
    raw = json.load(open(path))
    arch = raw.get("architectures") or [raw.get("model_type")]
    if arch != ["LlamaForCausalLM"]:
        raise HFFormatError(f"{path}: architecture {arch} is not supported; this converter reads "
                            f"LlamaForCausalLM checkpoints (Llama 2/3.x, TinyLlama)")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, want) != want:
            raise HFFormatError(f"{path}: {key}={raw[key]!r} is not supported (Llama uses {want!r})")
    theta, factor = _rope(raw, path)
    heads = raw["num_attention_heads"]
    config = HFLlamaConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        max_position_embeddings=raw["max_position_embeddings"], rope_theta=theta,
        rms_norm_eps=raw["rms_norm_eps"], tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling_factor=factor, bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        torch_dtype=str(raw.get("dtype", raw.get("torch_dtype", "float32"))),
    )
    head_dim = raw.get("head_dim") or config.head_dim
    if head_dim * heads != config.hidden_size:
        raise HFFormatError(f"{path}: head_dim {head_dim} x num_attention_heads {heads} != hidden_size "
                            f"{config.hidden_size}; megatron's Llama needs head_dim = hidden_size / heads")
    return config


def config_json(config: HFLlamaConfig, dtype: str) -> dict:
    """A transformers ``LlamaConfig`` dict (4.x keys, which 5.x also reads) for ``config``."""
    fields = asdict(config)
    factor = fields.pop("rope_scaling_factor")
    fields.pop("torch_dtype")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "head_dim": config.head_dim, **fields,
        "rope_scaling": None if factor is None else {"rope_type": "llama3", "factor": factor,
                                                     **LLAMA3_ROPE_CONSTANTS},
        "torch_dtype": dtype, "use_cache": True,
    }


def weight_files(hf_dir: str) -> dict[str, str]:
    """Tensor name -> path of the safetensors file holding it; every named shard must exist."""
    index_path = os.path.join(hf_dir, INDEX)
    if os.path.isfile(index_path):
        weight_map = json.load(open(index_path))["weight_map"]
        files = {name: os.path.join(hf_dir, f) for name, f in weight_map.items()}
        missing = sorted({f for f in files.values() if not os.path.isfile(f)})
        if missing:
            raise HFFormatError(f"{index_path} names shard {missing[0]} (and {len(missing) - 1} more), which is "
                                f"missing; download every file the index names")
        return files
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single)[0]}
    raise HFFormatError(f"--load-dir {hf_dir}: no {SINGLE_FILE} or {INDEX}; only safetensors weights are read "
                        f"(convert .bin weights with transformers' save_pretrained(safe_serialization=True))")


# safetensors dtype -> (numpy type of the same width, torch dtype); numpy has no bfloat16.
_ST_DTYPES = {"F64": (np.float64, torch.float64), "F32": (np.float32, torch.float32),
              "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16)}


def read_header(path: str) -> tuple[dict, int]:
    """(tensor name -> {dtype, shape, data_offsets}, offset of the data) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class MappedWeights:
    """The tensors of a model's safetensors files, each memory-mapped on its own when asked for.

    A tensor is a copy-on-write view of its bytes in the file (numpy.memmap): reading it faults
    in file-backed pages (page cache, which the kernel reclaims under memory pressure), never
    anonymous memory, and its storage is exactly the tensor (checkpoint writers that copy views
    of larger storages do not copy it).
    """

    def __init__(self, files: dict[str, str]):
        self.files = files
        self._headers = {path: read_header(path) for path in sorted(set(files.values()))}

    def get(self, name: str) -> torch.Tensor:
        path = self.files[name]
        header, data_start = self._headers[path]
        entry = header[name]
        if entry["dtype"] not in _ST_DTYPES:
            raise HFFormatError(f"{path}: tensor {name} has dtype {entry['dtype']}; the converter reads "
                                f"{', '.join(_ST_DTYPES)} weights")
        np_type, dtype = _ST_DTYPES[entry["dtype"]]
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        if end - start != int(np.prod(shape)) * np.dtype(np_type).itemsize:
            raise HFFormatError(f"{path}: tensor {name} has {end - start} bytes for shape {shape}; the file is "
                                f"damaged, download it again")
        array = np.memmap(path, dtype=np_type, mode="c", offset=data_start + start, shape=shape)
        return torch.from_numpy(array).view(dtype)


def file_backed_empty(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose memory is a new file at ``path``, unlinked at once (the
    mapping keeps it until the tensor is freed): the kernel writes its pages out and drops them
    under memory pressure, as it cannot with anonymous memory."""
    np_type = next(np_t for np_t, t in _ST_DTYPES.values() if t == dtype)
    array = np.memmap(path, dtype=np_type, mode="w+", shape=tuple(shape))
    os.unlink(path)
    return torch.from_numpy(array).view(dtype)


def _save_atomic(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: str, max_shard_bytes: int) -> list[str]:
    """Write ``tensors`` as safetensors shards of at most ``max_shard_bytes`` (a tensor larger than
    that gets a shard of its own) and the index; one shard in memory at a time. Returns the files."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    names_per_shard: list[list[str]] = [[]]
    size, total, written = 0, 0, []

    def flush() -> None:
        tmp_name = f"model-{len(written) + 1:05d}.safetensors"
        _save_atomic(shards[-1], os.path.join(out_dir, tmp_name))
        written.append(tmp_name)
        shards[-1] = {}

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            names_per_shard.append([])
            size = 0
        shards[-1][name] = tensor.contiguous()
        names_per_shard[-1].append(name)
        size += nbytes
        total += nbytes
    flush()
    # Hugging Face's naming: model-00001-of-00003.safetensors (renamed now that the count is known).
    final = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    for old, new in zip(written, final):
        os.replace(os.path.join(out_dir, old), os.path.join(out_dir, new))
    index = {"metadata": {"total_size": total},
             "weight_map": {n: f for f, names in zip(final, names_per_shard) for n in names}}
    write_text_atomic(os.path.join(out_dir, INDEX), json.dumps(index, indent=2) + "\n")
    return final
