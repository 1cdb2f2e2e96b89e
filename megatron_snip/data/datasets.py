"""Megatron indexed datasets: writing them from text (``tools/preprocess_data.py``) and building
the train/valid/test ``GPTDataset``s the training loop reads from them (or, for ``--mock-data``,
megatron-core's synthetic ``MockGPTDataset``s).

An indexed dataset is megatron-core's pair ``<prefix>.bin`` (all token ids, back to back, in the
index's dtype) and ``<prefix>.idx`` (lengths and offsets of the documents). Preprocessing names
them like Megatron-LM: ``<output-prefix>_<json-key>_document``, and that prefix is what
``--data-path`` takes.
"""

import dataclasses
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.indexed_dataset import (  # the index reader and header: to check a file's integrity
    _INDEX_HEADER,
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    _IndexReader,
    get_bin_path,
    get_idx_path,
)
from megatron.core.datasets.utils import Split
from torch.utils.data import Dataset
from tqdm import tqdm

from megatron_snip.data.corpus import check_input, is_jsonl, parse_line
from megatron_snip.data.tokenizer import (
    SENTENCEPIECE_TOKENIZER,
    SentencePieceTokenizer,
    build_tokenizer,
)

# Documents per task handed to a preprocessing worker; Megatron-LM's preprocess_data.py uses 32.
WORKER_CHUNKSIZE = 32


# --------------------------------------------------------------------------------------------
# Writing: text -> indexed dataset


@dataclass(frozen=True)
class PreprocessConfig:
    """Settings of ``preprocess`` (Megatron-LM's ``tools/preprocess_data.py`` flag names).

    Attributes:
        input: JSONL or plain-text file (see ``megatron_snip.data.corpus``).
        output_prefix: outputs go to ``<output_prefix>_<key>_document.{bin,idx}``.
        tokenizer_type: ``--tokenizer-type`` (``SentencePieceTokenizer``).
        tokenizer_model: ``--tokenizer-model``, a SentencePiece ``.model`` file.
        json_keys: JSONL keys to tokenize; one dataset per key.
        append_eod: append the tokenizer's end-of-document id to every document.
        workers: tokenizing processes; 1 tokenizes in this process.
        log_interval: print a progress line every this many input lines.
        progress: show a tqdm progress bar (on stderr).
    """

    input: str
    output_prefix: str
    tokenizer_model: str
    tokenizer_type: str = SENTENCEPIECE_TOKENIZER
    json_keys: tuple[str, ...] = ("text",)
    append_eod: bool = False
    workers: int = 1
    log_interval: int = 1000
    progress: bool = True


@dataclass(frozen=True)
class PreprocessSummary:
    """Outcome of ``preprocess``.

    Attributes:
        prefixes: json key -> written dataset prefix (the ``--data-path`` value).
        documents: input documents written (those with text under at least one key).
        tokens: tokens written, over all keys, eod included.
        dtype: numpy dtype name of the token ids in the ``.bin``.
        seconds: wall time in seconds.
    """

    prefixes: dict[str, str]
    documents: int
    tokens: int
    dtype: str
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Throughput over the whole run, start-up included."""
        return self.tokens / max(self.seconds, 1e-9)


def output_prefix_for_key(output_prefix: str, key: str) -> str:
    """Megatron-LM's dataset prefix for one json key: ``<output_prefix>_<key>_document``."""
    return f"{output_prefix}_{key}_document"


class _Encoder:
    """Tokenizes numbered input lines. As in Megatron-LM, the tokenizer is a class attribute set
    by ``initializer`` in each worker process, so it is loaded once per process instead of being
    pickled with every task."""

    tokenizer: SentencePieceTokenizer

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config
        self.jsonl = is_jsonl(config.input)

    def initializer(self) -> None:
        _Encoder.tokenizer = build_tokenizer(
            self.config.tokenizer_type, self.config.tokenizer_model
        )

    def encode(self, numbered_line: tuple[int, str]) -> tuple[dict[str, list[int]] | None, int]:
        """Token ids per key of one line (None for a blank line) and the line's size in bytes."""
        lineno, line = numbered_line
        where = f"{self.config.input}:{lineno}"
        document = parse_line(line, self.config.json_keys, self.jsonl, where)
        size = len(line.encode("utf-8"))
        if document is None:
            return None, size
        ids = {}
        for key, text in document.items():
            ids[key] = self.tokenizer.tokenize(text)
            if ids[key] and self.config.append_eod:
                ids[key].append(self.tokenizer.eod)
        return ids, size


def _encoded_lines(
    config: PreprocessConfig, encoder: _Encoder
) -> Iterator[tuple[dict[str, list[int]] | None, int]]:
    """``encoder.encode`` of every input line, in input order (``Pool.imap`` keeps it, so the
    output does not depend on the number of workers)."""
    with open(config.input, encoding="utf-8") as f:
        numbered = enumerate(f, start=1)
        if config.workers == 1:
            # In-process: no worker start-up, which dominates on small inputs.
            yield from map(encoder.encode, numbered)
            return
        with multiprocessing.Pool(config.workers, initializer=encoder.initializer) as pool:
            yield from pool.imap(encoder.encode, numbered, WORKER_CHUNKSIZE)


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize ``config.input`` into one megatron-core indexed dataset per json key, one
    sequence per document.

    Token ids are stored in the smallest dtype that holds the vocabulary
    (``DType.optimal_dtype``: uint16 below 65500 ids). The output is identical for any number
    of workers. Empty documents are not written. On error no ``.idx`` is written and the
    partial ``.bin`` files are removed, so no half-written dataset is left behind.

    Raises:
        FileNotFoundError: missing input or tokenizer model.
        ValueError: bad JSON line or missing key (the message names ``file:line``), bad
            tokenizer, ``workers`` < 1.
    """
    start = time.perf_counter()
    check_input(config.input)
    if config.workers < 1:
        raise ValueError(f"--workers {config.workers}: must be at least 1")
    encoder = _Encoder(config)
    encoder.initializer()
    dtype = DType.optimal_dtype(encoder.tokenizer.vocab_size)

    prefixes = {key: output_prefix_for_key(config.output_prefix, key) for key in config.json_keys}
    Path(config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {
        key: IndexedDatasetBuilder(get_bin_path(prefix), dtype=dtype)
        for key, prefix in prefixes.items()
    }
    documents = tokens = total_bytes = 0
    try:
        bar = tqdm(total=_count_lines(config.input), unit="doc", disable=not config.progress)
        with bar:
            for i, (ids, size) in enumerate(_encoded_lines(config, encoder), start=1):
                bar.update()
                total_bytes += size
                if ids and any(ids.values()):
                    documents += 1
                    for key, doc_ids in ids.items():
                        if doc_ids:
                            builders[key].add_document(doc_ids, [len(doc_ids)])
                            tokens += len(doc_ids)
                if i % config.log_interval == 0:
                    elapsed = time.perf_counter() - start
                    bar.write(
                        f"Processed {i} documents ({i / elapsed:.1f} docs/s, "
                        f"{total_bytes / elapsed / 2**20:.2f} MB/s).",
                        file=sys.stderr,
                    )
        for key, builder in builders.items():
            builder.finalize(get_idx_path(prefixes[key]))
    except BaseException:
        for key, builder in builders.items():
            builder.data_file.close()
            Path(get_bin_path(prefixes[key])).unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - start
    return PreprocessSummary(prefixes, documents, tokens, np.dtype(dtype).name, seconds)


# --------------------------------------------------------------------------------------------
# Reading: indexed datasets -> train/valid/test GPTDatasets


def parse_data_path(data_path: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` list as (prefixes, weights or None).

    Accepts ``[prefix, ...]`` or ``[w1, prefix1, w2, prefix2, ...]``: the weighted form is
    recognized by an even length whose first item is a number, as in megatron-core's
    ``get_blend_from_list``.

    Raises:
        ValueError: empty list, a weight that is not a finite positive number, or a number among
            unweighted prefixes (a blend missing a weight or a prefix: megatron-core would look
            for ``0.7.bin``).
    """
    items = [str(item).strip() for item in data_path]
    if not items:
        raise ValueError("--data-path: no dataset prefix given")
    if len(items) % 2 == 1 or not _is_number(items[0]):
        numbers = [item for item in items if _is_number(item)]
        if numbers:
            raise ValueError(
                f"--data-path {' '.join(items)}: {numbers[0]!r} looks like a blend weight, but weights and "
                f"prefixes come in pairs, each weight before its prefix ('w1 prefix1 w2 prefix2 ...'; "
                f"{len(items)} items given)"
            )
        return items, None
    weights, prefixes = items[0::2], items[1::2]
    for weight in weights:
        # megatron-core's BlendedDataset asserts every weight is > 0.
        if not _is_number(weight) or not math.isfinite(float(weight)) or float(weight) <= 0:
            raise ValueError(
                f"--data-path: blend weight {weight!r} is not a positive number; expected "
                "'w1 prefix1 w2 prefix2 ...' or 'prefix1 prefix2 ...'"
            )
    return prefixes, [float(w) for w in weights]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_data_prefixes(prefixes: Sequence[str]) -> None:
    """Raise FileNotFoundError naming ``--data-path`` and the first missing ``.bin``/``.idx``."""
    for prefix in prefixes:
        for path in (get_bin_path(prefix), get_idx_path(prefix)):
            if not os.path.isfile(path):
                hint = (
                    "; --data-path takes the prefix, without .bin/.idx"
                    if prefix.endswith((".bin", ".idx"))
                    else ""
                )
                raise FileNotFoundError(
                    f"--data-path {prefix}: {path} not found{hint}. Build it with "
                    "tools/preprocess_data.py --output-prefix P, which writes "
                    "P_text_document.bin/.idx"
                )
        check_indexed_dataset(prefix)


def check_indexed_dataset(prefix: str) -> None:
    """Raise ValueError naming the file if ``prefix``'s ``.idx`` cannot be read or its ``.bin`` does
    not hold exactly the tokens the index points at (a truncated copy, a full disk, a file of another
    dataset), before megatron-core reads past the end or trains on garbage."""
    idx, bin_path = get_idx_path(prefix), get_bin_path(prefix)
    rebuild = "rebuild it with tools/preprocess_data.py"
    try:
        with open(idx, "rb") as f:
            header = f.read(len(_INDEX_HEADER))
        if header != _INDEX_HEADER:
            raise ValueError("bad header: not a megatron indexed-dataset .idx")
        index = _IndexReader(idx, multimodal=False)
        if index.document_indices.size == 0 or index.document_indices[-1] != index.sequence_count:
            raise ValueError("its document table does not end at its sequence count")
    except (AssertionError, ValueError, KeyError, OSError) as e:  # megatron-core asserts on bad files
        raise ValueError(f"--data-path {prefix}: {idx} is corrupt ({str(e).split(chr(10))[0]}); {rebuild}") from None
    expected = (int(index.sequence_pointers[-1]) + int(index.sequence_lengths[-1]) * index.dtype_size
                if index.sequence_count else 0)
    actual = os.path.getsize(bin_path)
    if actual != expected:
        raise ValueError(f"--data-path {prefix}: {bin_path} has {actual} bytes but {idx} indexes {expected} "
                         f"(truncated, or the files of different datasets); {rebuild}")


def load_tokens(prefix: str) -> np.ndarray:
    """All token ids of an indexed dataset, memory-mapped (read-only, no copy), in file order."""
    dtype = IndexedDataset(prefix).index.dtype
    if os.path.getsize(get_bin_path(prefix)) == 0:
        return np.empty(0, dtype=dtype)  # np.memmap refuses empty files
    return np.memmap(get_bin_path(prefix), dtype=dtype, mode="r")


# Checks and statistics read at most this many tokens per dataset, so a launch
# over terabytes of data does not scan them all on every rank.
SAMPLE_TOKENS = 1 << 25
_SAMPLE_CHUNKS = 64


def sample_tokens(prefix: str, max_tokens: int = SAMPLE_TOKENS) -> np.ndarray:
    """All tokens of a dataset, or ``max_tokens`` of them in evenly spaced contiguous chunks."""
    tokens = load_tokens(prefix)
    if tokens.size <= max_tokens:
        return tokens
    chunk = max_tokens // _SAMPLE_CHUNKS
    starts = np.linspace(0, tokens.size - chunk, _SAMPLE_CHUNKS).astype(np.int64)
    return np.concatenate([tokens[s:s + chunk] for s in starts])


def check_vocab_covers_data(prefixes: Sequence[str], vocab_size: int, tokenizer: str = "the tokenizer",
                            fix: str = "rerun tools/preprocess_data.py with this tokenizer") -> None:
    """Raise ValueError naming ``--data-path`` and ``tokenizer`` (how the flags gave the vocabulary) if a
    dataset holds a token id >= ``vocab_size`` (data tokenized with another tokenizer), ending in ``fix``.
    Reads each ``.bin`` whole up to ``SAMPLE_TOKENS`` tokens, else a sample of that size (a foreign
    tokenizer's ids show up everywhere, so a sample finds them)."""
    for prefix in prefixes:
        tokens = sample_tokens(prefix)
        max_id = int(tokens.max()) if tokens.size else -1
        if max_id >= vocab_size:
            raise ValueError(f"--data-path {prefix} holds token id {max_id}, but {tokenizer} has only {vocab_size} "
                             f"ids: the data was preprocessed with a different tokenizer; {fix}")


def check_splits_have_documents(prefixes: Sequence[str], split: str) -> None:
    """Raise ValueError naming ``--split``/``--data-path`` if a split given a share gets no
    documents of some dataset.

    megatron-core 0.16.1 loops forever building such a split (``GPTDataset._get_num_epochs``
    keeps adding empty epochs), e.g. the default ``--split 969,30,1`` on fewer than 500
    documents. Documents are assigned exactly as ``BlendedMegatronDatasetBuilder`` does.
    """
    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    for prefix in prefixes:
        n = IndexedDataset(prefix).sequence_lengths.shape[0]
        for which, bookends in zip(Split, matrix):
            if bookends is not None and round(bookends[0] * n) == round(bookends[1] * n):
                raise ValueError(
                    f"--split {split} gives the {which.name} split none of the {n} documents of "
                    f"--data-path {prefix}, and megatron-core would loop forever building it; "
                    "give that split a larger share, or a share of 0 to drop it (e.g. "
                    "--split 98,2,0 has no test split), or use more documents"
                )


def megatron_num_samples(
    train_iters: int, eval_iters: int, eval_interval: int, global_batch_size: int, train_samples: int | None = None
) -> tuple[int, int, int]:
    """Samples needed per split (train, valid, test), with Megatron-LM's formula: training ``train_samples``
    (--train-samples) or ``train_iters`` batches, validation ``eval_iters`` batches every ``eval_interval``
    iterations and once at the end, test once."""
    evaluations = train_iters // eval_interval + 1
    return (
        train_iters * global_batch_size if train_samples is None else train_samples,
        evaluations * eval_iters * global_batch_size,
        eval_iters * global_batch_size,
    )


@dataclass(frozen=True)
class GPTDataConfig:
    """Where the GPT training data comes from and how samples are cut (Megatron-LM flag names).

    Attributes:
        data_path: ``--data-path``: ``[prefix, ...]`` or ``[w1, prefix1, w2, prefix2, ...]``; None:
            ``split_paths``, else megatron-core's mock data (``--mock-data``), which splits 1,1,1 whatever
            ``split`` says.
        split_paths: instead of ``data_path`` and ``split``: ``--train-data-path``, ``--valid-data-path``,
            ``--test-data-path``, each a ``data_path`` or None (no such split); megatron-core's
            ``blend_per_split``.
        seq_length: ``--seq-length``, tokens per sample (each sample reads one extra token for
            the shifted labels).
        split: ``--split``, relative document shares of train,valid,test, e.g. ``"969,30,1"``.
        seed: ``--seed`` of the sample shuffling and blending.
        reset_position_ids: restart position ids after every eod.
        reset_attention_mask: block attention across eod.
        eod_mask_loss: no loss on eod targets.
        create_attention_mask: have the dataset emit an attention mask (False when the attention
            kernel builds the causal mask itself).
        path_to_cache: ``--data-cache-path`` for the index caches (default: ``cache/`` next to
            the data).
        mmap_bin_files: memory-map the ``.bin`` files (``--no-mmap-bin-files`` turns it off).
    """

    data_path: tuple[str, ...] | None
    seq_length: int
    split: str | None = "969,30,1"
    split_paths: tuple[tuple[str, ...] | None, ...] | None = None
    seed: int = 1234
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    create_attention_mask: bool = True
    path_to_cache: str | None = None
    mmap_bin_files: bool = True


class _Builder(BlendedMegatronDatasetBuilder):
    """megatron-core's builder, also usable without torch.distributed.

    In megatron-core 0.16.1 ``BlendedDataset`` calls ``torch.distributed.get_rank()`` whenever
    it writes its index cache, which raises when no process group is initialized (a single
    process: tools, tests, notebooks). There, blends skip that cache; the blending index of a
    run takes milliseconds to rebuild. ``GPTDataset`` caches are unaffected.
    """

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        if cls is BlendedDataset and not torch.distributed.is_initialized():
            *dataset_args, config = args
            args = (*dataset_args, dataclasses.replace(config, path_to_cache=None))
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def _checked_blend(data_path: Sequence[str], tokenizer) -> tuple[list[str], list[float] | None]:
    """megatron-core's blend of a ``--data-path``-like list, its files and their ids checked."""
    prefixes, weights = parse_data_path(data_path)
    check_data_prefixes(prefixes)
    check_vocab_covers_data(prefixes, tokenizer.vocab_size)
    return prefixes, weights


def build_gpt_datasets(
    config: GPTDataConfig,
    tokenizer: SentencePieceTokenizer,
    num_samples: tuple[int | None, int | None, int | None],
    is_built_on_rank: Callable[[], bool] = lambda: True,
) -> tuple[Dataset | None, Dataset | None, Dataset | None]:
    """Train, valid and test datasets (a ``GPTDataset``, a ``BlendedDataset`` over several, or without
    ``config.data_path`` a ``MockGPTDataset``) through megatron-core's ``BlendedMegatronDatasetBuilder``,
    as Megatron-LM's pretrain_gpt does.

    Each item is a dict of int64/float tensors: tokens, labels, loss_mask, position_ids
    (and attention_mask), each ``seq_length`` long. A split with no documents is None.

    Args:
        config: the data settings.
        tokenizer: supplies eod/pad ids and the vocabulary size checked against the data.
        num_samples: samples wanted per split (see ``megatron_num_samples``); datasets repeat
            epochs to reach them. Must be given for every split a weighted blend uses.
        is_built_on_rank: whether this rank builds the datasets (in Megatron-LM: tensor-parallel
            rank 0 of the first and last pipeline stages); the builder synchronizes ranks with
            torch.distributed barriers only when torch.distributed is initialized.

    Raises:
        FileNotFoundError: a ``.bin``/``.idx`` of ``--data-path`` is missing.
        ValueError: bad blend weights, data with ids beyond the tokenizer's vocabulary, or a
            split left without documents.
    """
    blend = blend_per_split = None  # neither: megatron-core's mock data (its config sets split 1,1,1)
    if config.data_path is not None:
        blend = _checked_blend(config.data_path, tokenizer)
        check_splits_have_documents(blend[0], config.split)
    elif config.split_paths is not None:
        blend_per_split = [None if p is None else _checked_blend(p, tokenizer) for p in config.split_paths]
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split else config.split,
        path_to_cache=config.path_to_cache,
        mmap_bin_files=config.mmap_bin_files,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        create_attention_mask=config.create_attention_mask,
    )
    real = blend or blend_per_split
    builder = _Builder(GPTDataset if real else MockGPTDataset, list(num_samples), is_built_on_rank, gpt_config)
    train, valid, test = builder.build()
    return train, valid, test
