"""The training run's datasets, from validated arguments."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from torch.utils.data import Dataset

from megatron_snip.data.datasets import GPTDataConfig, build_gpt_datasets, megatron_num_samples
from megatron_snip.data.stats import data_unigram_entropy


@dataclass
class Datasets:
    train: Dataset
    valid: Dataset | None
    test: Dataset | None
    unigram_entropy: float  # nats/token of the data stream: the no-context loss level


def build_datasets_from_args(args: argparse.Namespace, tokenizer) -> Datasets:
    """Train/valid/test GPT datasets sized for the run (Megatron-LM's sample counts)."""
    config = GPTDataConfig(
        data_path=tuple(args.data_path),
        seq_length=args.seq_length,
        split=args.split,
        seed=args.seed,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        # The attention kernels build the causal mask themselves; only document
        # boundaries need an explicit one.
        create_attention_mask=args.reset_attention_mask,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
    )
    num_samples = megatron_num_samples(max(args.train_iters, 1), args.eval_iters, args.eval_interval,
                                       args.global_batch_size)
    train, valid, test = build_gpt_datasets(config, tokenizer, num_samples)
    if train is None:
        raise ValueError(f"--split {args.split} leaves no training documents; give the first field a share")
    if args.eval_iters > 0 and valid is None:
        raise ValueError(f"--split {args.split} leaves no validation documents but --eval-iters is "
                         f"{args.eval_iters}; give the second field a share or pass --eval-iters 0")
    return Datasets(train, valid, test, data_unigram_entropy(args.data_path))
