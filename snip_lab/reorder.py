"""The noise floor's data: the training documents in another order, the others where they were.

The comparison's noise-floor arm (``comparison.NOISE``) is the BF16 reference trained again from
the same trunk on another data order: its paired gap to the BF16 branch is what two identical
precisions differ by when only the batches differ, the floor under which no difference between
arms means anything. Passing it another ``--seed`` would reshuffle the validation samples too (the
GPT datasets of every split are shuffled by the run's seed), so its validation loss would be
measured on other text. Instead it reads a copy of each dataset whose *training* documents are
permuted: megatron-core splits a dataset into contiguous document ranges (``--split``), so the
validation and test documents keep their places and the same seed draws the same validation
samples, while the training samples, drawn by the same seed from a permuted document list, are
other documents in another order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

DEFAULT_SPLIT = "969,30,1"  # pretrain_llama.py's --split default (Megatron-LM's)


def training_documents(num_documents: int, split: str) -> int:
    """How many leading documents megatron-core's dataset builder gives the training split."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    train = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]
    return 0 if train is None else int(round(train[1] * float(num_documents)))


def document_order(num_documents: int, num_train: int, seed: int) -> np.ndarray:
    """The copy's document order: the first ``num_train`` documents permuted (seeded), the rest in place."""
    order = np.arange(num_documents)
    order[:num_train] = np.random.default_rng(seed).permutation(num_train)
    return order


def reordered_copy(prefix: str, out_prefix: str, split: str, seed: int) -> None:
    """Write ``out_prefix``.bin/.idx: ``prefix``'s documents in :func:`document_order`. The index is
    written last (renamed into place), so an existing ``.idx`` means a complete copy."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path

    if Path(get_idx_path(out_prefix)).exists():
        return
    source = IndexedDataset(prefix)
    n = len(source)
    order = document_order(n, training_documents(n, split), seed)
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out_prefix}.tmp"
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=source.index.dtype)
    for i in order:
        document = source[int(i)]
        builder.add_document(document, [len(document)])
    builder.finalize(get_idx_path(tmp))
    os.replace(get_bin_path(tmp), get_bin_path(out_prefix))
    os.replace(get_idx_path(tmp), get_idx_path(out_prefix))


def flag_values(args: Sequence[str], flag: str) -> tuple[int, int] | None:
    """(start, end) of the values of ``flag`` in ``args`` (up to the next ``--`` flag), or None."""
    if flag not in args:
        return None
    start = args.index(flag) + 1
    end = start
    while end < len(args) and not args[end].startswith("--"):
        end += 1
    return start, end


def reordered_data_args(train_args: Sequence[str], directory: Path, seed: int) -> list[str]:
    """``train_args`` with every ``--data-path`` prefix replaced by its reordered copy under
    ``directory`` (built on first use; blend weights kept)."""
    from megatron_snip.data.datasets import parse_data_path

    span = flag_values(train_args, "--data-path")
    if span is None:
        raise ValueError("the noise-floor arm reorders the training documents of --data-path, which the training "
                         "flags do not give")
    split_span = flag_values(train_args, "--split")
    split = train_args[split_span[0]] if split_span else DEFAULT_SPLIT
    items = list(train_args[span[0]:span[1]])
    prefixes, _ = parse_data_path(items)
    copies = {}
    for k, prefix in enumerate(prefixes):
        copies[prefix] = str(directory / f"{k}_{Path(prefix).name}")
        reordered_copy(prefix, copies[prefix], split, seed)
    return [*train_args[:span[0]], *(copies.get(item, item) for item in items), *train_args[span[1]:]]
