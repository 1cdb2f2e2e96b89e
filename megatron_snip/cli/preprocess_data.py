"""Tokenize a JSONL or text corpus into megatron-core indexed datasets (.bin/.idx).

Same flags and output naming as Megatron-LM's tools/preprocess_data.py: writes
``<output-prefix>_<key>_document.bin/.idx`` per json key. Example (the quickstart's data)::

    python tools/preprocess_data.py --input data/stdlib.jsonl --output-prefix data/stdlib \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/stdlib_sp.model \\
        --append-eod --workers 2

then train with ``--data-path data/stdlib_text_document``.
"""

import argparse
import sys
import warnings

# Importing megatron.core warns about optional GPU kernels that data tools never use.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron_snip.cli import config_from_args  # noqa: E402 (after the filter)
from megatron_snip.data.datasets import PreprocessConfig, preprocess  # noqa: E402 (after the filter)
from megatron_snip.data.tokenizer import TOKENIZER_TYPES  # noqa: E402 (after the filter)


def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", required=True,
                       help="SentencePiece .model file, or for HuggingFaceTokenizer a tokenizer.json or the model "
                            "directory holding it")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", required=True, help="JSONL (*.jsonl, *.json) or text file")
    group.add_argument(
        "--json-keys", nargs="+", default=["text"], help="space separated JSON keys to tokenize"
    )
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument(
        "--append-eod", action="store_true", help="append an <eod> token to every document"
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix", required=True, help="path of the outputs without _<key>_document.bin"
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    group.add_argument(
        "--log-interval", type=int, default=1000, help="documents between progress lines"
    )
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = get_args(argv)
    try:
        s = preprocess(config_from_args(PreprocessConfig, args))
    except (FileNotFoundError, ValueError) as e:  # input problems: the message says it all
        sys.exit(f"preprocess_data.py: error: {e}")
    for key, prefix in s.prefixes.items():
        print(f"Wrote {prefix}.bin/.idx ({key!r}); use --data-path {prefix}")
    print(
        f"{s.documents} documents, {s.tokens} tokens ({s.dtype}), {s.seconds:.2f} s, "
        f"{s.tokens_per_second:,.0f} tokens/s"
    )


if __name__ == "__main__":
    main()
