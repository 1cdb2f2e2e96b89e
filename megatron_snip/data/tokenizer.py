"""The SentencePiece tokenizer: training a model for code, and using it through megatron-core's
tokenizer interface.

Special ids follow Megatron-LM's ``GPTSentencePieceTokenizer``: ``eod`` is the model's ``eos``
id, ``pad``/``bos``/``eos`` are the model's own. ``train_tokenizer`` reserves pad=0, unk=1,
bos=2, eos=3.

Whitespace and newlines (see docs/data.md): SentencePiece normally collapses runs of spaces and
is trained on one line per "sentence", so indentation and newlines would be lost. Training here
keeps every space (identity normalization, no extra-whitespace removal, no dummy prefix, pieces
made only of spaces allowed, so indentation becomes single tokens) and makes ``"\\n"`` itself a
user-defined piece. Documents are fed line by line with their ``"\\n"`` kept: a user-defined
piece is never merged with its neighbours, so this learns the same pieces as whole documents
would (measured: all but one piece of 1500), without SentencePiece's per-sentence length limit
(``max_sentence_length``) discarding every long document. Plain SentencePiece encode/decode
then round-trips multi-line text byte for byte (rare characters go through byte fallback), so
the wrapper needs no newline substitution, and any other SentencePiece consumer (Megatron-LM's
own tokenizer, HF) reads the same model identically.
"""

import io
import os
import random
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

from megatron_snip.data.config import HUGGINGFACE_TOKENIZER, NULL_TOKENIZER, SENTENCEPIECE_TYPES
from megatron_snip.data.corpus import iter_documents
from megatron_snip.data.vocab_tokenizer import VocabTokenizer

# Megatron-LM's --tokenizer-type values of tokenizer files: this module's, and data/hf_tokenizer.py's.
SENTENCEPIECE_TOKENIZER = SENTENCEPIECE_TYPES[0]
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, HUGGINGFACE_TOKENIZER)

# --------------------------------------------------------------------------------------------
# Using a model

class SentencePieceTokenizer(VocabTokenizer):
    """A SentencePiece model as a megatron-core tokenizer.

    Args:
        model_file: path to a ``.model`` file, e.g. one written by ``tools/train_tokenizer.py``.

    Raises:
        ValueError: the model defines no eos id, so there is no end-of-document token.
    """

    def __init__(self, model_file: str) -> None:
        self._model_file = model_file
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(
                f"--tokenizer-model {model_file}: the model defines no eos id, which Megatron uses "
                "as the end-of-document token; retrain it with tools/train_tokenizer.py"
            )
        super().__init__(model_file, {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())},
                         eos=self._sp.eos_id(), bos=self._sp.bos_id(), pad=self._sp.pad_id())

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._sp.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; control ids (pad, bos, eos/eod) decode to nothing."""
        return self._sp.decode([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        """Number of ids, i.e. every id is in ``[0, vocab_size)``."""
        return self._sp.get_piece_size()

    @property
    def model_file(self) -> str:
        """Path of the SentencePiece model."""
        return self._model_file

    def score(self, token_id: int) -> float:
        """The model's score of a piece (log-probability for unigram, merge rank for BPE)."""
        return self._sp.get_score(token_id)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None = None):
    """The tokenizer named by Megatron's ``--tokenizer-type`` / ``--tokenizer-model`` flags:
    a SentencePiece ``.model`` file, for ``HuggingFaceTokenizer`` a Hugging Face model
    directory or ``tokenizer.json`` (data/hf_tokenizer.py), or ``NullTokenizer`` of
    ``vocab_size`` ids (no file).

    Raises:
        ValueError: unknown ``tokenizer_type``, no ``tokenizer_model`` (or ``vocab_size``) given, or
            the file is not a tokenizer of that type.
        FileNotFoundError: ``tokenizer_model`` does not exist.
    """
    if tokenizer_type == NULL_TOKENIZER:
        return null_tokenizer(vocab_size)
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"--tokenizer-type {tokenizer_type!r} is not supported; "
            f"choose one of: {', '.join(TOKENIZER_TYPES)}"
        )
    if not tokenizer_model:
        raise ValueError(f"--tokenizer-model is required with --tokenizer-type {tokenizer_type}")
    if tokenizer_type == HUGGINGFACE_TOKENIZER:
        return _build_hf_tokenizer(tokenizer_model)
    if not os.path.isfile(tokenizer_model):
        raise FileNotFoundError(
            f"--tokenizer-model {tokenizer_model}: no such file; "
            "train one with tools/train_tokenizer.py"
        )
    try:
        return SentencePieceTokenizer(tokenizer_model)
    except (RuntimeError, OSError) as e:
        raise ValueError(
            f"--tokenizer-model {tokenizer_model}: not a SentencePiece model ({e})"
        ) from None


def null_tokenizer(vocab_size: int | None):
    """megatron-core's NullTokenizer with Megatron-LM 0.16.1's meaning of ``--vocab-size N``: ids 0..N-1 and
    the end-of-document id N, N + 1 ids in all (both its tokenizer libraries add the end-of-document id)."""
    if vocab_size is None or vocab_size < 1:
        raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (ids 0..N-1, then the "
                         f"end-of-document id N), not {vocab_size}")
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size)


def _build_hf_tokenizer(path: str) -> MegatronLegacyTokenizer:
    from megatron_snip.data.hf_tokenizer import TOKENIZER_JSON, HuggingFaceTokenizer

    json_file = os.path.join(path, TOKENIZER_JSON) if os.path.isdir(path) else path
    if not os.path.isfile(json_file):
        raise FileNotFoundError(f"--tokenizer-model {path}: no {json_file}; give a Hugging Face model directory "
                                f"with a {TOKENIZER_JSON} or the file itself")
    try:
        return HuggingFaceTokenizer(path)
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        if isinstance(e, ValueError) and str(e).startswith("--tokenizer-model"):
            raise
        raise ValueError(f"--tokenizer-model {path}: not a Hugging Face tokenizer.json ({e})") from None


# --------------------------------------------------------------------------------------------
# Training a model

MODEL_TYPES = ("bpe", "unigram")
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NEWLINE_PIECE = "\n"

_LINE = re.compile(r"[^\n]*\n|[^\n]+")

# Options that make SentencePiece lossless on source code (see the module docstring).
CODE_OPTIONS = dict(
    pad_id=PAD_ID,
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    user_defined_symbols=[NEWLINE_PIECE],
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_digits=True,
    byte_fallback=True,
    # Multi-threaded training is not reproducible run to run.
    num_threads=1,
    # Sentences are sampled here with our seed: SentencePiece's own sampling
    # (input_sentence_size > 0) differs from run to run even with a fixed seed.
    input_sentence_size=0,
)


@dataclass(frozen=True)
class TokenizerTrainingConfig:
    """Settings of ``train_tokenizer`` (flag names of ``tools/train_tokenizer.py``).

    Attributes:
        input: JSONL or plain-text corpus (see ``megatron_snip.data.corpus``).
        model_prefix: writes ``<model_prefix>.model`` and ``<model_prefix>.vocab``.
        vocab_size: number of ids, reserved and byte-fallback pieces included.
        model_type: ``bpe`` or ``unigram``.
        json_keys: JSONL keys whose texts are trained on.
        character_coverage: fraction of characters covered by character pieces; the rest are
            encoded as UTF-8 byte pieces.
        input_sentence_size: train on a seeded random sample of this many lines (0: all lines).
        max_sentence_length: lines longer than this many bytes are skipped by SentencePiece.
        seed: seed of the line sample.
    """

    input: str
    model_prefix: str
    vocab_size: int = 4096
    model_type: str = "bpe"
    json_keys: tuple[str, ...] = ("text",)
    character_coverage: float = 0.9995
    input_sentence_size: int = 0
    max_sentence_length: int = 4192
    seed: int = 1234


@dataclass(frozen=True)
class TokenizerTrainingSummary:
    """Outcome of ``train_tokenizer``.

    Attributes:
        model_file: the written ``.model`` path.
        vocab_size: number of ids.
        documents: documents read.
        sentences: lines trained on (after sampling).
        bytes: UTF-8 size of the documents.
        tokens: tokens of all documents under the trained model.
        roundtrip_failures: documents for which decode(encode(text)) != text (should be 0).
        seconds: wall time, including the round-trip check.
    """

    model_file: str
    vocab_size: int
    documents: int
    sentences: int
    bytes: int
    tokens: int
    roundtrip_failures: int
    seconds: float

    @property
    def bytes_per_token(self) -> float:
        """Compression of the training text: UTF-8 bytes per token."""
        return self.bytes / max(self.tokens, 1)


def split_lines(text: str) -> list[str]:
    """``text`` cut after every ``"\\n"``, which stays on its line. Only ``"\\n"`` splits:
    ``str.splitlines`` would also split on form feeds and other separators found in code."""
    return _LINE.findall(text)


def sample_lines(lines: Sequence[str], size: int, seed: int) -> list[str]:
    """A seeded random sample of ``size`` lines in their original order (all if ``size`` is 0
    or at least ``len(lines)``)."""
    if size <= 0 or size >= len(lines):
        return list(lines)
    return [lines[i] for i in sorted(random.Random(seed).sample(range(len(lines)), size))]


def write_vocab(tokenizer: SentencePieceTokenizer, path: str) -> None:
    """SentencePiece's human-readable ``.vocab`` listing: ``piece<TAB>score`` per id, with the
    newline piece written as ``\\n`` to keep one line per id. Nothing reads this file back."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(tokenizer.vocab_size):
            piece = tokenizer.inv_vocab[i].replace(NEWLINE_PIECE, "\\n")
            f.write(f"{piece}\t{tokenizer.score(i):g}\n")


def train_tokenizer(config: TokenizerTrainingConfig) -> TokenizerTrainingSummary:
    """Train a SentencePiece model for code on ``config.input``; deterministic given the input
    and config.

    Raises:
        ValueError: bad ``model_type``, no text in the input, or SentencePiece rejects the
            settings (e.g. ``vocab_size`` below the 256 byte pieces plus the characters kept).
        FileNotFoundError: ``config.input`` does not exist.
    """
    start = time.perf_counter()
    if config.model_type not in MODEL_TYPES:
        raise ValueError(f"--model-type {config.model_type!r}: choose one of {MODEL_TYPES}")
    documents = iter_documents(config.input, config.json_keys)
    texts = [text for document in documents for text in document.values()]
    lines = [line for text in texts for line in split_lines(text)]
    if not lines:
        raise ValueError(f"--input {config.input}: no text to train on")
    lines = sample_lines(lines, config.input_sentence_size, config.seed)

    # Written through model_writer, so the model does not record its own output path and is
    # byte-identical wherever it is written.
    model = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            character_coverage=config.character_coverage,
            max_sentence_length=config.max_sentence_length,
            minloglevel=2,  # SentencePiece's per-step log is hundreds of lines
            **CODE_OPTIONS,
        )
    except RuntimeError as e:  # e.g. a vocabulary too small for the 256 byte pieces + characters
        raise ValueError(f"SentencePiece training failed: {e}") from None
    model_file = config.model_prefix + ".model"
    Path(model_file).parent.mkdir(parents=True, exist_ok=True)
    Path(model_file).write_bytes(model.getvalue())

    tokenizer = SentencePieceTokenizer(model_file)
    write_vocab(tokenizer, config.model_prefix + ".vocab")
    tokens, failures = 0, 0
    for text in texts:
        ids = tokenizer.tokenize(text)
        tokens += len(ids)
        failures += tokenizer.detokenize(ids) != text
    return TokenizerTrainingSummary(
        model_file=model_file,
        vocab_size=tokenizer.vocab_size,
        documents=len(texts),
        sentences=len(lines),
        bytes=sum(len(text.encode("utf-8")) for text in texts),
        tokens=tokens,
        roundtrip_failures=failures,
        seconds=time.perf_counter() - start,
    )
