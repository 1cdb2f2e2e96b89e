"""What both of our tokenizers are to megatron-core: a fixed piece -> id vocabulary with its special ids.

``tokenizer.py``'s SentencePiece tokenizer and ``hf_tokenizer.py``'s Hugging Face one subclass
:class:`VocabTokenizer`; each adds how it turns text into ids and back.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

_LEGACY_NOTICE_LOGGER = "megatron.core.datasets.megatron_tokenizer"


@contextlib.contextmanager
def _without_legacy_notice() -> Iterator[None]:
    """Silence the deprecation notice megatron-core logs on every tokenizer construction.

    In megatron-core 0.16.1 ``GPTDataset`` needs only ``eod``/``pad``/``vocab_size`` and the
    ``unique_identifiers`` this base class provides, so the "please migrate" notice is noise
    (printed once per preprocessing worker).
    """
    logger = logging.getLogger(_LEGACY_NOTICE_LOGGER)

    def drop_notice(record: logging.LogRecord) -> bool:
        return "legacy tokenizer system" not in record.getMessage()

    logger.addFilter(drop_notice)
    try:
        yield
    finally:
        logger.removeFilter(drop_notice)


class VocabTokenizer(MegatronLegacyTokenizer):
    """A megatron-core tokenizer (``MegatronLegacyTokenizer``, the abstract class of
    ``megatron.core.datasets.megatron_tokenizer`` in 0.16.1) over a fixed vocabulary.

    Args:
        source: the tokenizer's file or directory (megatron-core's identifier of the tokenizer).
        vocab: piece -> id.
        eos: the end-of-sequence id, which is also the end-of-document id (as in Megatron-LM).
        bos, pad: the beginning-of-sequence and padding ids, -1 where there is none (megatron-core
            then pads with -1 itself).
    """

    def __init__(self, source: str, vocab: Mapping[str, int], *, eos: int, bos: int, pad: int) -> None:
        with _without_legacy_notice():
            super().__init__(source)
        self._vocab = dict(vocab)
        self._inv_vocab = {i: piece for piece, i in self._vocab.items()}
        self._eos, self._bos, self._pad = eos, bos, pad

    @property
    def vocab(self) -> dict[str, int]:
        """Piece -> id."""
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece."""
        return self._inv_vocab

    @property
    def eod(self) -> int:
        """End-of-document id (the eos id, as in Megatron-LM)."""
        return self._eos

    @property
    def eos(self) -> int:
        """End-of-sequence id (same as ``eod``)."""
        return self._eos

    @property
    def bos(self) -> int:
        """Beginning-of-sequence id, -1 if there is none."""
        return self._bos

    @property
    def pad(self) -> int:
        """Padding id, -1 if there is none."""
        return self._pad
