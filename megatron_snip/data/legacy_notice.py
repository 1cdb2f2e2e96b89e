"""megatron-core's "please migrate" notice, silenced around the construction of our tokenizers.

Both tokenizers (``tokenizer.py``'s SentencePiece one, ``hf_tokenizer.py``'s Hugging Face one) subclass
megatron-core's ``MegatronLegacyTokenizer``, which logs the notice every time one is built.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

_LEGACY_NOTICE_LOGGER = "megatron.core.datasets.megatron_tokenizer"


@contextlib.contextmanager
def without_legacy_notice() -> Iterator[None]:
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
