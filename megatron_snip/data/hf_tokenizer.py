"""A Hugging Face ``tokenizer.json`` (Llama 3's BPE, or any fast tokenizer) through the
``tokenizers`` library, as a megatron-core tokenizer: ``--tokenizer-type HuggingFaceTokenizer``.

``--tokenizer-model`` is a directory (a model snapshot: ``tokenizer.json`` and usually
``tokenizer_config.json``) or a ``tokenizer.json`` file. Special ids as Megatron-LM's
``_HuggingFaceTokenizer`` (which wraps ``transformers.AutoTokenizer``): ``tokenize`` applies the
tokenizer's post-processor, so Llama 3 documents start with ``<|begin_of_text|>`` exactly as
``AutoTokenizer(text).input_ids`` gives them; ``eod`` = ``eos`` = the ``eos_token`` of
``tokenizer_config.json`` (``<|end_of_text|>`` for base Llama 3), which ``--append-eod`` appends.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from megatron_snip.data.vocab_tokenizer import VocabTokenizer

HUGGINGFACE_TOKENIZER = "HuggingFaceTokenizer"
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# End-of-text tokens of common tokenizers, for a tokenizer.json without a tokenizer_config.json.
_KNOWN_EOS = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")


def tokenizer_files(path: str) -> dict[str, str]:
    """File name -> path of the tokenizer files at ``path`` (a directory or a tokenizer.json)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    files = {TOKENIZER_JSON: os.path.join(folder, TOKENIZER_JSON) if os.path.isdir(path) else path}
    for name in (TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP):
        if os.path.isfile(os.path.join(folder, name)):
            files[name] = os.path.join(folder, name)
    return files


def _token(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


class HuggingFaceTokenizer(VocabTokenizer):
    """A ``tokenizer.json`` as a megatron-core tokenizer.

    Raises:
        ValueError: the end-of-document token cannot be determined, or names no token.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        files = tokenizer_files(path)
        self._tok = Tokenizer.from_file(files[TOKENIZER_JSON])
        config = json.load(open(files[TOKENIZER_CONFIG])) if TOKENIZER_CONFIG in files else {}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos = _token(config.get("eos_token")) or next((t for t in _KNOWN_EOS if t in vocab), None)
        if eos is None or eos not in vocab:
            raise ValueError(f"--tokenizer-model {path}: cannot tell the end-of-document token (no eos_token in a "
                             f"{TOKENIZER_CONFIG} next to {TOKENIZER_JSON}, and none of {list(_KNOWN_EOS)}); give "
                             f"the model directory with its {TOKENIZER_CONFIG}")
        super().__init__(path, vocab, eos=vocab[eos], bos=vocab.get(_token(config.get("bos_token")), -1),
                         pad=vocab.get(_token(config.get("pad_token")), -1))
        self._path = path

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text``, with the special tokens the tokenizer's post-processor adds (BOS)."""
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (``len(AutoTokenizer)``)."""
        return self._tok.get_vocab_size(with_added_tokens=True)
