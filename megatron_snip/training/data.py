"""The training run's datasets."""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils.data import Dataset

from megatron_snip.data.config import DataConfig
from megatron_snip.data.datasets import GPTDataConfig, build_gpt_datasets
from megatron_snip.data.stats import data_unigram_entropy, mock_unigram_entropy


@dataclass
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None
    unigram_entropy: float  # nats/token of the data stream: the no-context loss level


def build_datasets(data: DataConfig, tokenizer, *, seq_length: int, seed: int,
                   num_samples: tuple[int, int, int]) -> Datasets:
    """Train/valid/test GPT datasets of ``num_samples`` samples each (``megatron_num_samples``), from
    ``--data-path``, the per-split paths or megatron-core's mock data (``--mock-data``)."""
    per_split = (data.train_data_path, data.valid_data_path, data.test_data_path)
    config = GPTDataConfig(
        data_path=None if data.mock_data else data.data_path,
        seq_length=seq_length,
        split=data.split,
        split_paths=per_split if any(p is not None for p in per_split) else None,
        seed=seed,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        # The attention kernels build the causal mask themselves; only document
        # boundaries need an explicit one.
        create_attention_mask=data.reset_attention_mask,
        path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files,
    )
    train, valid, test = build_gpt_datasets(config, tokenizer, num_samples)
    if train is None:
        raise ValueError(f"--split {data.split} leaves no training documents; give the first field a share")
    if num_samples[1] > 0 and valid is None:
        raise ValueError(f"--split {data.split} leaves no validation documents but --eval-iters is "
                         "above 0; give the second field a share or pass --eval-iters 0")
    entropy = mock_unigram_entropy(tokenizer) if data.mock_data else \
        data_unigram_entropy(list(data.data_path or data.train_data_path))
    return Datasets(train, valid, test, entropy)
