"""Text corpora: the Python-stdlib source corpus, and reading documents from JSONL or text.

The quickstart trains on the interpreter's own standard library because it is real text that
exists on every machine with Python, needs no network, and is a few MB of well-formed code.

Two input formats are understood by every tool of the pipeline (tokenizer training,
preprocessing):

* JSONL (``*.jsonl`` / ``*.json``): one JSON object per line; the document text is under one or
  more keys (``--json-keys``, default ``text``), as in Megatron-LM's ``preprocess_data.py``.
* plain text (any other suffix): one document per line, the line terminator is not part of the
  document. Multi-line documents (code) therefore need JSONL.
"""

import json
import os
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

JSONL_SUFFIXES = (".jsonl", ".json")

# Directory names that hold the stdlib's own test suites (``test``, ``lib2to3/tests``,
# ``idlelib/idle_test``); they are 2/3 of the stdlib's bytes and very repetitive.
TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})

# Third-party code lives under these names inside the stdlib directory; it is not stdlib text.
THIRD_PARTY_DIR_NAMES = frozenset({"site-packages", "dist-packages"})


@dataclass(frozen=True)
class CorpusConfig:
    """What ``build_corpus`` collects and where it writes it.

    Attributes:
        output: path of the JSONL file to write.
        max_docs: keep at most this many documents (None: no limit).
        max_bytes: keep at most this many bytes of UTF-8 text in total (None: no limit). The
            default, 4 MB (~1.3M tokens at 4096 pieces), is more text than a minutes-long CPU
            run consumes, so validation text stays unseen.
        seed: seed of the random subset drawn when a limit applies.
        exclude_tests: skip the stdlib's test directories (``TEST_DIR_NAMES``).
        root: directory to collect from; None means the running interpreter's stdlib.
    """

    output: str
    max_docs: Optional[int] = None
    max_bytes: Optional[int] = 4_000_000
    seed: int = 1234
    exclude_tests: bool = False
    root: Optional[str] = None


@dataclass(frozen=True)
class CorpusSummary:
    """Outcome of ``build_corpus``: documents written, their UTF-8 size in bytes, source files
    that could not be used (unreadable or not UTF-8; empty files are left out silently), and
    wall time in seconds."""

    documents: int
    bytes: int
    skipped: int
    seconds: float


@dataclass(frozen=True)
class Document:
    """One source file: its path relative to the corpus root (POSIX separators) and its text."""

    path: str
    text: str


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory (the base one, also in a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path, exclude_tests: bool) -> list[Path]:
    """All ``*.py`` files under ``root``, sorted by relative path, skipping third-party package
    directories (and test directories if ``exclude_tests``).

    Sorting makes the corpus independent of the filesystem's directory order.
    """
    skipped_dirs = THIRD_PARTY_DIR_NAMES | (TEST_DIR_NAMES if exclude_tests else frozenset())
    sources = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skipped_dirs]
        sources.extend(Path(directory, f) for f in files if f.endswith(".py"))
    return sorted(sources, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> Optional[str]:
    """The text of ``path`` decoded as UTF-8 with newlines normalized to ``\\n``, or None when
    the file cannot be read or is not valid UTF-8 (the stdlib ships a few deliberately
    mis-encoded test files)."""
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def select_documents(
    documents: Sequence[Document], max_docs: Optional[int], max_bytes: Optional[int], seed: int
) -> list[Document]:
    """A seeded random subset of ``documents`` within the limits, returned in input order.

    Sampling (rather than taking the first files alphabetically) keeps a small corpus as varied
    as the whole stdlib. Documents are visited in a seeded random order and kept while they fit;
    a document larger than the remaining byte budget is skipped so smaller ones can fill it.
    Without limits every document is kept and ``seed`` is unused.
    """
    if max_docs is None and max_bytes is None:
        return list(documents)
    order = list(range(len(documents)))
    random.Random(seed).shuffle(order)
    kept, total = [], 0
    for i in order:
        if max_docs is not None and len(kept) >= max_docs:
            break
        size = len(documents[i].text.encode("utf-8"))
        if max_bytes is not None and total + size > max_bytes:
            continue
        kept.append(i)
        total += size
    return [documents[i] for i in sorted(kept)]


def build_corpus(config: CorpusConfig) -> CorpusSummary:
    """Write the stdlib (or ``config.root``) ``*.py`` files as JSONL, one
    ``{"text": ..., "path": ...}`` object per line, sorted by path.

    The output is a pure function of the source tree and the config, so two runs give
    byte-identical files.
    """
    start = time.perf_counter()
    root = Path(config.root) if config.root is not None else stdlib_root()
    documents, skipped = [], 0
    for path in list_sources(root, config.exclude_tests):
        text = read_source(path)
        if text is None:
            skipped += 1
        elif text:  # empty files (package markers) are not documents
            documents.append(Document(path.relative_to(root).as_posix(), text))
    documents = select_documents(documents, config.max_docs, config.max_bytes, config.seed)

    Path(config.output).parent.mkdir(parents=True, exist_ok=True)
    total_bytes = 0
    with open(config.output, "w", encoding="utf-8") as out:
        for doc in documents:
            out.write(json.dumps({"text": doc.text, "path": doc.path}, ensure_ascii=False) + "\n")
            total_bytes += len(doc.text.encode("utf-8"))
    return CorpusSummary(len(documents), total_bytes, skipped, time.perf_counter() - start)


def is_jsonl(path: str) -> bool:
    """Whether ``path`` is read as JSONL (by suffix) rather than as one document per line."""
    return path.endswith(JSONL_SUFFIXES)


def parse_json_line(line: str, keys: Sequence[str], where: str) -> dict[str, str]:
    """The texts under ``keys`` of one JSONL line.

    Args:
        line: the raw line.
        keys: JSON keys to extract.
        where: ``file:line`` used in error messages.

    Raises:
        ValueError: the line is not a JSON object, a key is missing, or a value is not a string.
    """
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    texts = {}
    for key in keys:
        if key not in record:
            raise ValueError(
                f"{where}: missing key {key!r} (--json-keys {' '.join(keys)}); "
                f"the line has keys {sorted(record)}"
            )
        if not isinstance(record[key], str):
            raise ValueError(f"{where}: value of {key!r} is {type(record[key]).__name__}, not str")
        texts[key] = record[key]
    return texts


def check_input(path: str) -> None:
    """Raise FileNotFoundError naming ``--input`` if ``path`` is not a readable file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--input {path}: no such file")


def parse_line(line: str, keys: Sequence[str], jsonl: bool, where: str) -> Optional[dict[str, str]]:
    """``{key: text}`` for one input line (see module doc), or None for a blank line, which is
    not a document.

    For plain text every key maps to the line without its terminator, so callers need not care
    about the format. ``where`` (``file:line``) is used in error messages.
    """
    if not line.strip():
        return None
    if jsonl:
        return parse_json_line(line, keys, where)
    text = line.rstrip("\n")
    return {key: text for key in keys}


def iter_documents(path: str, keys: Sequence[str]) -> Iterator[dict[str, str]]:
    """Yield ``{key: text}`` per document of a JSONL or plain-text file."""
    check_input(path)
    jsonl = is_jsonl(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            document = parse_line(line, keys, jsonl, f"{path}:{lineno}")
            if document is not None:
                yield document
