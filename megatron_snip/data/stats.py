"""Unigram entropy of the training data: the loss a model with no context would reach.

A language model's cross-entropy (nats/token, the unit of Megatron's ``lm loss``) starts near
``ln(vocab_size)`` and drops below the unigram entropy only once it uses context, so printing
the two side by side tells whether a short run learned more than token frequencies.
"""

from collections.abc import Sequence

import numpy as np

from megatron_snip.data.datasets import parse_data_path, sample_tokens


def entropy_from_counts(counts: np.ndarray) -> float:
    """Entropy in nats of the distribution proportional to ``counts`` (zeros ignored)."""
    counts = np.asarray(counts, dtype=np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def unigram_entropy(tokens: np.ndarray) -> float:
    """Unigram entropy in nats/token of a stream of non-negative integer token ids."""
    if len(tokens) == 0:
        raise ValueError("unigram entropy of an empty token stream is undefined")
    return entropy_from_counts(np.bincount(tokens))


def data_unigram_entropy(data_path: Sequence[str]) -> float:
    """Unigram entropy in nats/token of the token stream Megatron draws from ``--data-path``.

    For a weighted blend ``[w1, prefix1, ...]`` the stream is the mixture ``sum_i w_i p_i`` of
    the datasets' unigram distributions (weights normalized); without weights, the datasets are
    drawn in proportion to their sizes, i.e. their token counts are pooled. eod tokens count as
    tokens, since the model is trained to predict them. All splits are included. Datasets
    larger than ``SAMPLE_TOKENS`` are estimated from an evenly spaced sample of that size.
    """
    prefixes, weights = parse_data_path(data_path)
    counts = [np.bincount(sample_tokens(prefix)) for prefix in prefixes]
    for prefix, c in zip(prefixes, counts):
        if c.sum() == 0:
            raise ValueError(f"--data-path {prefix}: dataset has no tokens")
    size = max(len(c) for c in counts)
    counts = [np.pad(c, (0, size - len(c))).astype(np.float64) for c in counts]
    if weights is None:
        return entropy_from_counts(sum(counts))
    mixture = sum(w / sum(weights) * c / c.sum() for w, c in zip(weights, counts))
    return entropy_from_counts(mixture)


def mock_unigram_entropy(tokenizer) -> float:
    """Unigram entropy in nats/token of megatron-core's mock data (``--mock-data``) for ``tokenizer``,
    exactly, over all its documents: document ``d`` of length ``L_d`` is the ids ``1, 2, ..., L_d - 1``
    modulo the vocabulary, then the end-of-document id."""
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset

    docs = MockGPTLowLevelDataset(tokenizer)
    body = np.sort(docs.sequence_lengths.astype(np.int64) - 1)  # ids before each end-of-document
    positions = np.arange(1, body.max() + 1)
    reach = len(body) - np.searchsorted(body, positions, side="left")  # documents with an id at each position
    counts = np.bincount(positions % docs.vocab_size, weights=reach, minlength=docs.vocab_size)
    counts[docs.eod_token] += len(body)
    return entropy_from_counts(counts)

