"""Build a JSONL corpus: the running interpreter's standard-library ``*.py`` files, English prose, or C/C++ headers.

Examples (the quickstart's corpus, about 4 MB; the prose corpus, 3.7 MB, from Debian's packages
debian-handbook and fortunes; a seeded 4 MB subset of the C and C++ headers under /usr/include, from
libc6-dev, linux-libc-dev, libstdc++-12-dev and whatever other -dev packages are installed)::

    python tools/build_corpus.py --output data/stdlib.jsonl --exclude-tests
    python tools/build_corpus.py --source prose --output data/prose.jsonl
    python tools/build_corpus.py --source c --output data/ccode.jsonl
"""

import argparse
import sys

# Like Megatron-LM's tools: runnable from a checkout without `pip install -e .`.
from megatron_snip.cli import config_from_args
from megatron_snip.data.corpus import (
    C_PACKAGES,
    FORTUNES_DIR,
    HANDBOOK_DIR,
    INCLUDE_DIR,
    SOURCES,
    CorpusConfig,
    build_corpus,
    stdlib_root,
)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument(
        "--source",
        choices=SOURCES,
        default="stdlib",
        help="stdlib: this Python's standard-library source (the quickstart's); prose: The Debian "
        f"Administrator's Handbook ({HANDBOOK_DIR}) and the fortunes ({FORTUNES_DIR}), from "
        f"`apt-get install debian-handbook fortunes`; c: the C and C++ headers under {INCLUDE_DIR} "
        f"(*.h, *.hpp, *.tcc, ..., libstdc++'s extensionless ones), from `{C_PACKAGES}` and any other -dev package",
    )
    parser.add_argument(
        "--max-docs", type=int, default=None, help="keep at most this many documents (default: all)"
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=CorpusConfig.max_bytes,
        help="keep at most this many bytes of text (default: %(default)s; 0: no limit)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=CorpusConfig.seed,
        help="seed of the random subset drawn under the limits, and of the prose and c corpora's document order",
    )
    parser.add_argument(
        "--exclude-tests",
        action="store_true",
        help="skip the stdlib's test directories (test, tests, idle_test; --source stdlib)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = get_args(argv)
    args.max_bytes = args.max_bytes or None  # the flag's 0 is the config's "no limit"
    try:
        summary = build_corpus(config_from_args(CorpusConfig, args))
    except FileNotFoundError as e:  # the prose or C corpus's Debian packages are not installed
        sys.exit(f"build_corpus.py: error: {e}")
    origin = {"stdlib": stdlib_root(), "prose": f"{HANDBOOK_DIR} and {FORTUNES_DIR}", "c": INCLUDE_DIR}[args.source]
    print(
        f"Wrote {args.output} from {origin}: {summary.documents} documents, "
        f"{summary.bytes / 1e6:.2f} MB ({summary.bytes} bytes), "
        f"{summary.skipped} unreadable or non-UTF-8 files skipped, {summary.seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
