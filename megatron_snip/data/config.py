"""The run's data flags, validated once by ``arguments.py``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how samples are built (Megatron-LM's flags)."""

    # A prefix, or a blend "W1 PREFIX1 W2 PREFIX2 ..."; None only when launch scripts are checked without data.
    data_path: tuple[str, ...] | None
    split: str  # "train,valid,test" proportions
    tokenizer_type: str
    tokenizer_model: str | None
    data_cache_path: str | None
    num_workers: int  # data-loader workers per rank
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    mmap_bin_files: bool
