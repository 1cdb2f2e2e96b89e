"""The data pipeline: stdlib corpus -> SentencePiece tokenizer -> indexed dataset -> GPTDatasets.

Everything runs on a 40-file slice of the stdlib and an 800-piece tokenizer built once per module
under pytest's tmp directories.
"""

import importlib
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_snip.data.corpus import CorpusConfig, build_corpus, list_sources, select_documents
from megatron_snip.data.datasets import (
    GPTDataConfig,
    PreprocessConfig,
    build_gpt_datasets,
    check_vocab_covers_data,
    megatron_num_samples,
    parse_data_path,
    preprocess,
)
from megatron_snip.data.stats import data_unigram_entropy, unigram_entropy
from megatron_snip.data.tokenizer import (
    TokenizerTrainingConfig,
    build_tokenizer,
    split_lines,
    train_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
VOCAB_SIZE = 800


def load_tool(name: str):
    """A tool's module (megatron_snip/cli/), so its ``main(argv)`` runs in this process (no new
    interpreter, i.e. no second multi-second megatron import)."""
    return importlib.import_module(f"megatron_snip.cli.{name}")


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_indexed(prefix: Path, documents: list[list[int]]) -> str:
    """A hand-made uint16 indexed dataset, one sequence per document."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def documents_of(prefix: str) -> list[np.ndarray]:
    dataset = IndexedDataset(prefix)
    # Copies: the arrays view the dataset's mmap, which its __del__ unmaps.
    return [np.array(dataset[i]) for i in range(len(dataset))]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def corpus(data_dir) -> str:
    path = str(data_dir / "corpus.jsonl")
    build_corpus(CorpusConfig(output=path, max_docs=40, exclude_tests=True, seed=1234))
    return path


@pytest.fixture(scope="module")
def tokenizer_model(data_dir, corpus) -> str:
    summary = train_tokenizer(
        TokenizerTrainingConfig(
            input=corpus, model_prefix=str(data_dir / "sp"), vocab_size=VOCAB_SIZE
        )
    )
    assert summary.roundtrip_failures == 0
    return summary.model_file


@pytest.fixture(scope="module")
def tokenizer(tokenizer_model):
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model)


@pytest.fixture(scope="module")
def eod_prefix(data_dir, corpus, tokenizer_model) -> str:
    config = PreprocessConfig(
        input=corpus,
        output_prefix=str(data_dir / "eod"),
        tokenizer_model=tokenizer_model,
        append_eod=True,
        progress=False,
    )
    return preprocess(config).prefixes["text"]


# --- corpus --------------------------------------------------------------------------------


@pytest.mark.integration
def test_build_corpus_is_deterministic_and_cli_matches(tmp_path, corpus):
    again = tmp_path / "again.jsonl"
    build_corpus(CorpusConfig(output=str(again), max_docs=40, exclude_tests=True, seed=1234))
    assert again.read_bytes() == Path(corpus).read_bytes()

    docs = read_jsonl(corpus)
    assert len(docs) == 40
    paths = [d["path"] for d in docs]
    assert paths == sorted(paths)
    assert all(d["text"] and set(d) == {"text", "path"} for d in docs)
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for p in paths for part in p.split("/"))

    # The CLI imports no megatron, so a real subprocess is cheap here.
    cli = tmp_path / "cli.jsonl"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_corpus.py"), "--output", str(cli),
         "--max-docs", "40", "--exclude-tests", "--seed", "1234"],
        check=True, capture_output=True,
    )
    assert cli.read_bytes() == Path(corpus).read_bytes()


def test_corpus_skips_non_utf8_third_party_and_tests(tmp_path):
    root = tmp_path / "lib"
    for rel, data in {
        "a.py": b"x = 1\n",
        "pkg/b.py": "s = 'caf\u00e9'\r\n".encode(),
        "latin1.py": "s = 'caf\u00e9'\n".encode("latin-1"),
        "site-packages/third.py": b"y = 2\n",
        "test/test_a.py": b"assert True\n",
        "empty.py": b"",
    }.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)

    out = tmp_path / "c.jsonl"
    summary = build_corpus(CorpusConfig(output=str(out), root=str(root), exclude_tests=True))
    docs = read_jsonl(out)
    assert [d["path"] for d in docs] == ["a.py", "pkg/b.py"]
    assert docs[1]["text"] == "s = 'caf\u00e9'\n"  # newlines normalized
    assert (summary.documents, summary.skipped) == (2, 1)
    assert len(list_sources(root, exclude_tests=False)) == 5


HANDBOOK_PAGE = """<?xml version="1.0" encoding="UTF-8"?><html><head><title>6.2. apt</title></head><body>
<div id="banner"><a href="x"><span class="text">Download the ebook</span></a></div>
<p id="title"><a class="left" href="y"><img alt="Product Site" src="i.png" /></a></p>
<ul class="docnav top"><li class="previous"><a href="a.html"><strong>Prev</strong></a></li></ul>
<div class="section"><h2 class="title">6.2. <code class="command">apt</code> Commands</h2><div class="para">
			APT is a  vast project,
			whose plans &amp; goals grew.
		</div><pre class="screen"><code>$ apt update
  done</code></pre></div><ul class="docnav"><li class="next"><a href="b.html">Next</a></li></ul></body></html>"""


def test_prose_corpus_is_the_handbook_text_and_the_fortunes_in_a_seeded_order(tmp_path):
    from megatron_snip.data.corpus import html_to_text, split_fortunes

    # A Publican page: the page furniture (head, banner, navigation) goes, paragraphs become lines with
    # their whitespace collapsed, a <pre> keeps its line breaks, entities are decoded.
    assert html_to_text(HANDBOOK_PAGE) == ("6.2. apt Commands\nAPT is a vast project, whose plans & goals grew.\n"
                                           "$ apt update\ndone")
    assert split_fortunes("One.\n%\nTwo\n\tlines.  \n%\n%\n") == ["One.", "Two\n\tlines."]

    handbook, fortunes = tmp_path / "hb", tmp_path / "fortunes"
    handbook.mkdir()
    fortunes.mkdir()
    (handbook / "apt.html").write_text(HANDBOOK_PAGE)
    (handbook / "style.css").write_text("body {}")
    (fortunes / "food").write_text("Eat.\n%\nDrink.\n%\n")
    (fortunes / "food.dat").write_bytes(b"\x00\x02")  # strfile's index, not text
    (fortunes / "food.u8").symlink_to(fortunes / "food")  # the UTF-8 link to the same file
    (fortunes / "ascii-art").write_text(" /\\_/\\\n( o.o )\n%\n")  # drawings, not prose
    out = tmp_path / "prose.jsonl"
    cfg = dict(output=str(out), source="prose", handbook_dir=str(handbook), fortunes_dir=str(fortunes), seed=5)
    summary = build_corpus(CorpusConfig(**cfg))
    docs = {d["path"]: d["text"] for d in read_jsonl(out)}
    assert docs == {"handbook/apt.html": html_to_text(HANDBOOK_PAGE), "fortunes/food/0": "Eat.",
                    "fortunes/food/1": "Drink."}
    assert (summary.documents, summary.skipped) == (3, 0)
    # The order is seeded (megatron's --split takes contiguous document ranges: path order would put the last
    # fortune files alone in the validation split) and reproducible.
    orders = set()
    for seed in range(6):
        build_corpus(CorpusConfig(**{**cfg, "seed": seed}))
        orders.add(tuple(d["path"] for d in read_jsonl(out)))
    assert len(orders) > 1
    again = tmp_path / "again.jsonl"
    build_corpus(CorpusConfig(**{**cfg, "output": str(again), "seed": 5}))
    build_corpus(CorpusConfig(**cfg))
    assert again.read_bytes() == out.read_bytes()

    with pytest.raises(FileNotFoundError, match="apt-get install debian-handbook fortunes"):
        build_corpus(CorpusConfig(**{**cfg, "handbook_dir": str(tmp_path / "missing")}))
    with pytest.raises(ValueError, match="unknown corpus source 'poetry'"):
        CorpusConfig(output=str(out), source="poetry")


C_FILES = {  # what the C corpus collects: relative path -> bytes
    "stdio.h": b"#include <features.h>\n",
    "sys/types.h": b"typedef int pid_t;\n",
    "crlf.h": b"#define A 1\r\n#define B 2\r\n",
    "node/v8.hpp": b"namespace v8 {}\n",
    "kj/a.hh": b"class A;\n",
    "kj/b.hxx": b"class B;\n",
    "valgrind/x.c": b"int x;\n",
    "llvm/y.cc": b"int y;\n",
    "llvm/z.cpp": b"int z;\n",
    "llvm/w.cxx": b"int w;\n",
    "c++/12/vector": b"#include <bits/stl_vector.h>\n",  # libstdc++'s extensionless headers
    "c++/12/tr1/array": b"namespace std::tr1 {}\n",
    "c++/12/bits/vector.tcc": b"template<typename T> void f();\n",
    "x86_64-linux-gnu/c++/12/bits/c++config.h": b"#define _GLIBCXX 1\n",
    "libpng16/png.h": b"#define PNG 1\n",
    "node/openssl/archs/aix64/asn1.h": b"struct asn1;\n",  # the first of byte-identical copies
}
C_LEFT_OUT = {
    "latin1.h": "/* caf\u00e9 */\n".encode("latin-1"),  # not UTF-8: counted as skipped
    "empty.h": b"",
    "c++/README": b"text\n",  # extensionless, but not under c++/<version>/
    "Makefile": b"all:\n",
    "rpcsvc/nfs.x": b"program NFS {};\n",  # rpcgen's language
    "llvm/IR/Attributes.td": b"def A;\n",
    "c++/12/notes.txt": b"text\n",
    "node/openssl/archs/linux64/asn1.h": b"struct asn1;\n",  # a byte-identical copy: one document
}


def write_c_tree(root: Path, paths) -> None:
    for rel in paths:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes({**C_FILES, **C_LEFT_OUT}[rel])
    (root / "ncursesw").mkdir()
    # A symlinked file: skipped (it sorts before its target, so dropping copies alone would keep it instead).
    (root / "ncursesw" / "curses.h").symlink_to(root / "stdio.h")
    (root / "libpng").symlink_to(root / "libpng16")  # a symlinked directory: not entered


def test_c_corpus_is_the_c_and_cxx_files_under_include_in_a_seeded_order(tmp_path):
    root = tmp_path / "include"
    write_c_tree(root, [*C_FILES, *C_LEFT_OUT])
    out = tmp_path / "c.jsonl"
    cfg = dict(output=str(out), source="c", include_dir=str(root), seed=5)
    summary = build_corpus(CorpusConfig(**cfg))
    docs = {d["path"]: d["text"] for d in read_jsonl(out)}
    wanted = {rel: data.decode().replace("\r\n", "\n") for rel, data in C_FILES.items()}
    assert docs == wanted  # newlines normalized (crlf.h)
    assert (summary.documents, summary.skipped) == (len(wanted), 1)

    # The order is seeded (megatron's --split takes contiguous document ranges: path order would put the
    # alphabetically last directories alone in the validation split) and a pure function of the tree and the
    # seed: the same tree written in the opposite order (another directory order) gives the same bytes.
    orders = set()
    for seed in range(6):
        build_corpus(CorpusConfig(**{**cfg, "seed": seed}))
        orders.add(tuple(d["path"] for d in read_jsonl(out)))
    assert len(orders) > 1
    other = tmp_path / "other"
    write_c_tree(other, reversed([*C_FILES, *C_LEFT_OUT]))
    again = tmp_path / "again.jsonl"
    build_corpus(CorpusConfig(**{**cfg, "output": str(again), "include_dir": str(other)}))
    build_corpus(CorpusConfig(**cfg))
    assert again.read_bytes() == out.read_bytes()

    with pytest.raises(FileNotFoundError, match=re.escape("apt-get install libc6-dev linux-libc-dev libstdc++-12-dev")):
        build_corpus(CorpusConfig(**{**cfg, "include_dir": str(tmp_path / "missing")}))
    assert load_tool("build_corpus").get_args(["--output", str(out), "--source", "c"]).source == "c"


def test_select_documents_respects_limits(corpus):
    from megatron_snip.data.corpus import Document

    docs = [Document(d["path"], d["text"]) for d in read_jsonl(corpus)]
    picked = select_documents(docs, max_docs=None, max_bytes=100_000, seed=3)
    assert sum(len(d.text.encode()) for d in picked) <= 100_000
    assert picked == select_documents(docs, max_docs=None, max_bytes=100_000, seed=3)
    assert [d.path for d in picked] == sorted(d.path for d in picked)
    assert len(select_documents(docs, max_docs=7, max_bytes=None, seed=3)) == 7


# --- tokenizer -----------------------------------------------------------------------------


def test_tokenizer_training_is_deterministic(tmp_path, corpus, tokenizer_model):
    again = train_tokenizer(
        TokenizerTrainingConfig(
            input=corpus, model_prefix=str(tmp_path / "again"), vocab_size=VOCAB_SIZE
        )
    )
    assert Path(again.model_file).read_bytes() == Path(tokenizer_model).read_bytes()


def test_tokenizer_roundtrips_python_source_exactly(corpus, tokenizer):
    for doc in read_jsonl(corpus):
        assert tokenizer.detokenize(tokenizer.tokenize(doc["text"])) == doc["text"], doc["path"]

    tricky = (
        "class A:\n\n\n    def f(self):   \n\t\treturn  'caf\u00e9 \u2603'  # x\n"
        "        pass\n\x0c\n\r\n  \n"
    )
    assert tokenizer.detokenize(tokenizer.tokenize(tricky)) == tricky
    newline = tokenizer.vocab["\n"]
    assert tokenizer.tokenize("\n\n") == [newline, newline]
    # Indentation is learned as whitespace-only pieces, not one token per space.
    first = tokenizer.inv_vocab[tokenizer.tokenize("        return x")[0]]
    assert set(first) == {"\u2581"} and len(first) > 1


def test_tokenizer_special_ids(tokenizer, tokenizer_model):
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert (tokenizer.pad, tokenizer.bos, tokenizer.eos, tokenizer.eod) == (0, 2, 3, 3)
    assert len(tokenizer.vocab) == VOCAB_SIZE
    assert all(tokenizer.vocab[piece] == i for i, piece in tokenizer.inv_vocab.items())
    ids = tokenizer.tokenize("x = 1")
    assert tokenizer.detokenize([*ids, tokenizer.eod, tokenizer.pad]) == "x = 1"
    assert tokenizer.unique_identifiers["tokenizer_path"] == [tokenizer_model]


def test_split_lines_keeps_newlines_and_splits_only_on_them():
    assert split_lines("a\n\nb\x0cc\n  d") == ["a\n", "\n", "b\x0cc\n", "  d"]
    assert split_lines("") == []


def test_build_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="--tokenizer-type 'GPT2BPETokenizer'"):
        build_tokenizer("GPT2BPETokenizer", "x.model")
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*missing.model"):
        build_tokenizer("SentencePieceTokenizer", str(tmp_path / "missing.model"))
    garbage = tmp_path / "garbage.model"
    garbage.write_text("not a model")
    with pytest.raises(ValueError, match="--tokenizer-model .*not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", str(garbage))


# --- preprocessing -------------------------------------------------------------------------


def test_preprocess_roundtrip_with_eod(corpus, tokenizer, eod_prefix):
    docs = read_jsonl(corpus)
    stored = documents_of(eod_prefix)
    assert len(stored) == len(docs)
    assert stored[0].dtype == np.uint16
    for doc, ids in zip(docs, stored):
        assert ids[-1] == tokenizer.eod
        assert tokenizer.detokenize(ids[:-1]) == doc["text"]


def test_preprocess_cli_workers_match_and_without_eod(
    tmp_path, corpus, tokenizer_model, eod_prefix
):
    tool = load_tool("preprocess_data")
    common = ["--input", corpus, "--tokenizer-type", "SentencePieceTokenizer",
              "--tokenizer-model", tokenizer_model, "--log-interval", "10"]
    tool.main([*common, "--output-prefix", str(tmp_path / "w2"), "--workers", "2", "--append-eod"])
    for suffix in (".bin", ".idx"):
        written = Path(f"{tmp_path}/w2_text_document{suffix}").read_bytes()
        assert written == Path(eod_prefix + suffix).read_bytes()

    tool.main([*common, "--output-prefix", str(tmp_path / "plain"), "--workers", "1"])
    plain = documents_of(f"{tmp_path}/plain_text_document")
    with_eod = documents_of(eod_prefix)
    assert all(np.array_equal(p, e[:-1]) for p, e in zip(plain, with_eod))


def test_preprocess_plain_text_input(tmp_path, tokenizer_model, tokenizer):
    text = tmp_path / "lines.txt"
    text.write_text("first line\n\nsecond  line\n")
    summary = preprocess(PreprocessConfig(input=str(text), output_prefix=str(tmp_path / "t"),
                                          tokenizer_model=tokenizer_model, progress=False))
    decoded = [tokenizer.detokenize(ids) for ids in documents_of(summary.prefixes["text"])]
    assert decoded == ["first line", "second  line"]


def test_preprocess_errors(tmp_path, tokenizer_model):
    def run(path, **kwargs):
        config = PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "out"),
                                  tokenizer_model=tokenizer_model, progress=False, **kwargs)
        return preprocess(config)

    with pytest.raises(FileNotFoundError, match="--input .*nope.jsonl"):
        run(tmp_path / "nope.jsonl")

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        run(bad)
    assert not (tmp_path / "out_text_document.bin").exists()  # no half-written dataset

    keyless = tmp_path / "keyless.jsonl"
    keyless.write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(ValueError, match=r"keyless.jsonl:2: missing key 'text'"):
        run(keyless, workers=2)


@pytest.mark.parametrize("tool,args", [
    ("train_tokenizer", ["--model-prefix", "tok"]),
    ("preprocess_data", ["--output-prefix", "out", "--tokenizer-type", "SentencePieceTokenizer",
                         "--tokenizer-model", "tok.model"]),
])
def test_the_tools_say_an_input_problem_in_one_line(tmp_path, tool, args):
    """As its launcher (tools/NAME.py) and console script call it: ``main``, no traceback."""
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(SystemExit) as e:
        load_tool(tool).main(["--input", str(missing), *[str(tmp_path / a) if a.startswith(("tok", "out")) else a
                                                         for a in args]])
    assert e.value.code == f"{tool}.py: error: --input {missing}: no such file"


# --- GPT datasets --------------------------------------------------------------------------


def test_parse_data_path():
    assert parse_data_path(["p"]) == (["p"], None)
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    assert parse_data_path(["0.8", "a", "0.2", "b"]) == (["a", "b"], [0.8, 0.2])
    with pytest.raises(ValueError, match="--data-path: blend weight 'x'"):
        parse_data_path(["0.8", "a", "x", "b"])
    with pytest.raises(ValueError, match="--data-path: blend weight '0'"):
        parse_data_path(["1", "a", "0", "b"])


def test_megatron_num_samples():
    # 100 iterations, validation every 50 (at 50, 100) and at the end: 3 x 10 batches.
    assert megatron_num_samples(100, 10, 50, 8) == (800, 240, 80)


def test_gpt_datasets_from_preprocessed_data(tmp_path, monkeypatch, tokenizer, eod_prefix):
    import megatron.core.datasets.utils as megatron_utils

    def no_compile():
        raise AssertionError("compile_helpers must not be called: the wheel ships helpers_cpp")

    monkeypatch.setattr(megatron_utils, "compile_helpers", no_compile)
    config = GPTDataConfig(data_path=(eod_prefix,), seq_length=64, split="90,10,0",
                           path_to_cache=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets(config, tokenizer, (100, 20, 0))
    assert test is None and len(train) >= 100 and len(valid) >= 20
    sample = train[0]
    assert sample["tokens"].shape == sample["labels"].shape == (64,)
    assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
    assert int(sample["tokens"].max()) < tokenizer.vocab_size


def test_blend_weights_are_respected(tmp_path, tokenizer):
    a = write_indexed(tmp_path / "a", [[10] * 40 + [3]] * 50)
    b = write_indexed(tmp_path / "b", [[20] * 40 + [3]] * 50)
    config = GPTDataConfig(data_path=("0.8", a, "0.2", b), seq_length=16, split="100,0,0",
                           path_to_cache=str(tmp_path / "cache"))
    train, _, _ = build_gpt_datasets(config, tokenizer, (2000, 0, 0))
    from_a = sum(10 in train[i]["tokens"].tolist() for i in range(len(train)))
    assert len(train) >= 2000
    assert from_a / len(train) == pytest.approx(0.8, abs=0.02)


def test_per_split_data_paths_put_each_files_documents_in_its_split(tmp_path, tokenizer):
    """--train-data-path / --valid-data-path (megatron-core's blend_per_split): every training sample comes from
    the training files (a blend of two), every validation sample from the validation file; no test path, no test
    split."""
    a = write_indexed(tmp_path / "a", [[10] * 40 + [3]] * 30)
    b = write_indexed(tmp_path / "b", [[20] * 40 + [3]] * 30)
    v = write_indexed(tmp_path / "v", [[30] * 40 + [3]] * 30)
    config = GPTDataConfig(data_path=None, seq_length=16, split=None, split_paths=(("0.5", a, "0.5", b), (v,), None),
                           path_to_cache=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets(config, tokenizer, (400, 50, 0))
    train_ids = [set(train[i]["tokens"].tolist()) - {3} for i in range(len(train))]
    assert len(train) >= 400 and all(ids in ({10}, {20}) for ids in train_ids)
    assert {10} in train_ids and {20} in train_ids
    assert len(valid) >= 50 and all(set(valid[i]["tokens"].tolist()) <= {30, 3} for i in range(len(valid)))
    assert test is None


def test_gpt_dataset_errors(tmp_path, tokenizer, eod_prefix):
    def build(*data_path, split="90,10,0", samples=(10, 10, 0)):
        config = GPTDataConfig(data_path=data_path, seq_length=16, split=split,
                               path_to_cache=str(tmp_path / "cache"))
        return build_gpt_datasets(config, tokenizer, samples)

    missing = r"--data-path .*missing.bin not found.*preprocess_data.py"
    with pytest.raises(FileNotFoundError, match=missing):
        build(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="without .bin/.idx"):
        build(eod_prefix + ".bin")
    with pytest.raises(ValueError, match="--data-path: blend weight 'half'"):
        build("0.5", eod_prefix, "half", eod_prefix)

    too_big = write_indexed(tmp_path / "big", [[5, VOCAB_SIZE + 7, 3]] * 4)
    with pytest.raises(ValueError, match=rf"holds token id {VOCAB_SIZE + 7}, but the tokenizer has only"):
        build(too_big)
    with pytest.raises(ValueError, match=rf"holds token id {VOCAB_SIZE + 7}"):
        check_vocab_covers_data([too_big], VOCAB_SIZE)

    # 40 documents: a 1/1000 test share gets none, which megatron-core would loop on forever.
    with pytest.raises(ValueError, match="--split 969,30,1 gives the test split none of the 40"):
        build(eod_prefix, split="969,30,1", samples=(10, 10, 10))
    build(eod_prefix, split="969,30,0", samples=(10, 10, 0))


# --- stats ---------------------------------------------------------------------------------


def test_unigram_entropy_matches_hand_computation(tmp_path):
    # p = (1/2, 1/4, 1/4): H = 1/2 ln 2 + 2 * 1/4 ln 4 = 1.5 ln 2
    assert unigram_entropy(np.array([7, 7, 8, 9])) == pytest.approx(1.5 * math.log(2))
    a = write_indexed(tmp_path / "a", [[7, 7], [8, 9]])
    assert data_unigram_entropy([a]) == pytest.approx(1.5 * math.log(2))

    # Weighted blend: the mixture 0.5 * {7: 1} + 0.5 * {6: 1} has H = ln 2, whatever the sizes.
    b = write_indexed(tmp_path / "b", [[7] * 30])
    c = write_indexed(tmp_path / "c", [[6] * 10])
    assert data_unigram_entropy(["1", b, "1", c]) == pytest.approx(math.log(2))
    # Unweighted: token counts pool, p = (3/4, 1/4).
    pooled = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert data_unigram_entropy([b, c]) == pytest.approx(pooled)
