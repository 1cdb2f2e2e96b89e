"""Text corpora: the Python-stdlib source corpus, an English prose corpus, a C/C++ corpus, and
reading documents from JSONL or text.

The quickstart trains on the interpreter's own standard library because it is real text that
exists on every machine with Python, needs no network, and is a few MB of well-formed code.
The prose corpus (``source="prose"``) is text of another kind, for checking that what was
measured on code holds elsewhere: The Debian Administrator's Handbook (English HTML, stripped to
text, one document per page) and the fortune-cookie collections (one document per fortune),
both from Debian packages (``apt-get install debian-handbook fortunes``), about 3.7 MB.
The C corpus (``source="c"``) is a third kind, neither Python nor prose: the C and C++ headers
(and the few sources) that the installed Debian packages put under ``/usr/include`` (libc's, the
kernel's, libstdc++'s and every other ``-dev`` package's), a seeded 4 MB subset by default.

Two input formats are understood by every tool of the pipeline (tokenizer training,
preprocessing):

* JSONL (``*.jsonl`` / ``*.json``): one JSON object per line; the document text is under one or
  more keys (``--json-keys``, default ``text``), as in Megatron-LM's ``preprocess_data.py``.
* plain text (any other suffix): one document per line, the line terminator is not part of the
  document. Multi-line documents (code) therefore need JSONL.
"""

import html.parser
import json
import os
import random
import re
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json")

# Directory names that hold the stdlib's own test suites (``test``, ``lib2to3/tests``,
# ``idlelib/idle_test``); they are 2/3 of the stdlib's bytes and very repetitive.
TEST_DIR_NAMES = frozenset({"test", "tests", "idle_test"})

# Third-party code lives under these names inside the stdlib directory; it is not stdlib text.
THIRD_PARTY_DIR_NAMES = frozenset({"site-packages", "dist-packages"})

SOURCES = ("stdlib", "prose", "c")
# Where Debian's packages put the prose corpus's sources.
HANDBOOK_DIR = "/usr/share/doc/debian-handbook/html/en-US"  # package debian-handbook
FORTUNES_DIR = "/usr/share/games/fortunes"  # packages fortunes, fortunes-min
PROSE_PACKAGES = "apt-get install debian-handbook fortunes"
# Fortune files that are not prose (drawings), and the index / encoding-link companions of each file.
FORTUNE_SKIP = frozenset({"ascii-art"})
FORTUNE_SKIP_SUFFIXES = (".dat", ".u8")
# Where Debian's packages put the C corpus's sources: libc6-dev (glibc), linux-libc-dev (the kernel's
# uapi headers), libstdc++-12-dev (the C++ standard library, GCC 12), and any other -dev package.
INCLUDE_DIR = "/usr/include"
C_PACKAGES = "apt-get install libc6-dev linux-libc-dev libstdc++-12-dev"
C_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".tcc")


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
        root: directory to collect from (source "stdlib"); None means the running interpreter's stdlib.
        source: "stdlib" (Python source), "prose" (the handbook and the fortunes) or "c" (C and C++
            headers).
        handbook_dir, fortunes_dir: where the prose corpus's sources are (Debian's paths).
        include_dir: where the C corpus's sources are (Debian's path).
    """

    output: str
    max_docs: int | None = None
    max_bytes: int | None = 4_000_000
    seed: int = 1234
    exclude_tests: bool = False
    root: str | None = None
    source: str = "stdlib"
    handbook_dir: str = HANDBOOK_DIR
    fortunes_dir: str = FORTUNES_DIR
    include_dir: str = INCLUDE_DIR

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown corpus source {self.source!r}; choose from {list(SOURCES)}")


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


def list_files(root: Path, wanted: Callable[[Path], bool], skipped_dirs: frozenset = frozenset()) -> list[Path]:
    """The files under ``root`` whose path relative to ``root`` is ``wanted``, sorted by that path,
    not entering directories named in ``skipped_dirs`` nor symlinked directories (``os.walk``'s
    default, so nothing is visited twice).

    Sorting makes the corpus independent of the filesystem's directory order.
    """
    sources = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skipped_dirs]
        sources.extend(p for p in (Path(directory, f) for f in files) if wanted(p.relative_to(root)))
    return sorted(sources, key=lambda p: p.relative_to(root).as_posix())


def list_sources(root: Path, exclude_tests: bool) -> list[Path]:
    """All ``*.py`` files under ``root``, sorted by relative path, skipping third-party package
    directories (and test directories if ``exclude_tests``)."""
    skipped_dirs = THIRD_PARTY_DIR_NAMES | (TEST_DIR_NAMES if exclude_tests else frozenset())
    return list_files(root, lambda rel: rel.name.endswith(".py"), skipped_dirs)


def is_c_source(rel: Path) -> bool:
    """Whether a file at ``rel`` (relative to the include directory) is C or C++: by its suffix
    (``C_SUFFIXES``), or, without a suffix, by lying under a ``c++/<version>/`` directory, where the
    C++ standard library keeps its extensionless headers (``c++/12/vector``, ``c++/12/tr1/array``)."""
    if rel.name.endswith(C_SUFFIXES):
        return True
    return not rel.suffix and "c++" in rel.parts[:-2]


def read_source(path: Path) -> str | None:
    """The text of ``path`` decoded as UTF-8 with newlines normalized to ``\\n``, or None when
    the file cannot be read or is not valid UTF-8 (the stdlib ships a few deliberately
    mis-encoded test files)."""
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def select_documents(
    documents: Sequence[Document], max_docs: int | None, max_bytes: int | None, seed: int
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


def read_documents(root: Path, paths: Sequence[Path]) -> tuple[list[Document], int]:
    """One document per file of ``paths`` (named relative to ``root``), in their order, and how
    many files were unusable (unreadable or not UTF-8). Empty files (package markers, placeholder
    headers) are not documents."""
    documents, skipped = [], 0
    for path in paths:
        text = read_source(path)
        if text is None:
            skipped += 1
        elif text:
            documents.append(Document(path.relative_to(root).as_posix(), text))
    return documents, skipped


def in_seeded_order(documents: list[Document], seed: int) -> list[Document]:
    """``documents`` shuffled in place by ``seed`` (and returned), for corpora whose path order
    groups one kind of text together: megatron-core's ``--split`` takes contiguous ranges of
    documents, so in path order the validation split would hold only the last directory's kind."""
    random.Random(seed).shuffle(documents)
    return documents


def stdlib_documents(config: CorpusConfig) -> tuple[list[Document], int]:
    """The stdlib (or ``config.root``) ``*.py`` files, sorted by path, and how many were unusable."""
    root = Path(config.root) if config.root is not None else stdlib_root()
    return read_documents(root, list_sources(root, config.exclude_tests))


class _HtmlText(html.parser.HTMLParser):
    """The readable text of a DocBook/Publican HTML page: block elements end a line, whitespace
    inside a line collapses (the source indents with tabs), ``<pre>`` keeps its line breaks, and
    the page furniture (head, banner, title images, the prev/next navigation) is left out."""

    BLOCKS = frozenset({"p", "div", "br", "li", "dt", "dd", "tr", "pre", "h1", "h2", "h3", "h4", "h5", "h6",
                        "title", "table", "blockquote"})
    SKIPPED = frozenset({"head", "script", "style"})
    FURNITURE = (("id", "banner"), ("id", "title"), ("class", "docnav"))

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip_depth = 0  # > 0 inside a skipped element (counted by its own tag name)
        self.skip_tag: str | None = None
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        if self.skip_depth:
            self.skip_depth += tag == self.skip_tag
            return
        attrs = dict(attrs)
        if tag in self.SKIPPED or any((attrs.get(k) or "").split()[:1] == [v] for k, v in self.FURNITURE):
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if self.skip_depth:
            self.skip_depth -= tag == self.skip_tag
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip_depth:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_to_text(page: str) -> str:
    """A page's text, one paragraph (or ``<pre>`` line) per line, no blank lines, spaces collapsed."""
    parser = _HtmlText()
    parser.feed(page)
    parser.close()
    lines = (re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in "".join(parser.parts).split("\n"))
    return "\n".join(line for line in lines if line)


def split_fortunes(text: str) -> list[str]:
    """The fortunes of one strfile source (entries separated by a line holding only ``%``), each
    with trailing whitespace removed; empty entries dropped."""
    entries = re.split(r"^%[ \t]*$", text.replace("\r\n", "\n"), flags=re.MULTILINE)
    return [e for e in (entry.strip("\n").rstrip() for entry in entries) if e.strip()]


def prose_documents(config: CorpusConfig) -> tuple[list[Document], int]:
    """The handbook's pages (``handbook/<page>.html``) and every fortune (``fortunes/<file>/<n>``),
    in a seeded random order (``config.seed``, :func:`in_seeded_order`: in path order the validation
    split would be the last fortune files alone), and how many files were unusable (unreadable or
    not UTF-8).

    Raises FileNotFoundError naming the Debian packages when a source directory is missing.
    """
    handbook, fortunes = Path(config.handbook_dir), Path(config.fortunes_dir)
    for directory in (handbook, fortunes):
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: not found; the prose corpus is built from Debian packages "
                                    f"({PROSE_PACKAGES})")
    documents, skipped = [], 0
    for page in sorted(handbook.glob("*.html")):
        page_html = read_source(page)
        text = html_to_text(page_html) if page_html is not None else None
        if text is None:
            skipped += 1
        elif text:
            documents.append(Document(f"handbook/{page.name}", text))
    for path in sorted(fortunes.iterdir()):
        if (path.name in FORTUNE_SKIP or path.name.endswith(FORTUNE_SKIP_SUFFIXES) or path.is_symlink()
                or not path.is_file()):
            continue
        text = read_source(path)
        if text is None:
            skipped += 1
            continue
        documents += [Document(f"fortunes/{path.name}/{i}", f) for i, f in enumerate(split_fortunes(text))]
    return in_seeded_order(documents, config.seed), skipped


def c_documents(config: CorpusConfig) -> tuple[list[Document], int]:
    """Every regular C and C++ file under ``config.include_dir`` (:func:`is_c_source`), one document
    per file named by its path relative to that directory, in a seeded random order (``config.seed``,
    :func:`in_seeded_order`: in path order the validation split would be the alphabetically last
    directories alone, ``x*/`` to ``z*.h``, instead of a sample of every package's style), and how
    many files were unusable (unreadable or not UTF-8).

    A file that repeats another is not a second document: symlinks are skipped (ncursesw/ links to
    the headers beside it) and of byte-identical files only the first in path order is kept
    (nodejs ships OpenSSL's generated headers once per architecture under node/openssl/archs/:
    2,052 files, 137 distinct); a copy in the validation split would be text the model trained on.

    Raises FileNotFoundError naming the Debian packages when the directory is missing.
    """
    root = Path(config.include_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not found; the C corpus is built from the headers of Debian's -dev "
                                f"packages ({C_PACKAGES})")
    paths = [p for p in list_files(root, is_c_source) if p.is_file() and not p.is_symlink()]
    documents, skipped = read_documents(root, paths)
    seen, distinct = set(), []
    for doc in documents:
        if doc.text not in seen:
            seen.add(doc.text)
            distinct.append(doc)
    return in_seeded_order(distinct, config.seed), skipped


def build_corpus(config: CorpusConfig) -> CorpusSummary:
    """Write the corpus of ``config.source`` as JSONL, one ``{"text": ..., "path": ...}`` object per
    line (stdlib: the ``*.py`` files sorted by path; prose and c: :func:`prose_documents`' and
    :func:`c_documents`' seeded order).

    The output is a pure function of the source tree and the config, so two runs give
    byte-identical files.
    """
    start = time.perf_counter()
    collect = {"stdlib": stdlib_documents, "prose": prose_documents, "c": c_documents}[config.source]
    documents, skipped = collect(config)
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


def parse_line(line: str, keys: Sequence[str], jsonl: bool, where: str) -> dict[str, str] | None:
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
