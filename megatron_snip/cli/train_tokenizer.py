"""Train a SentencePiece tokenizer for source code on a JSONL or plain-text corpus.

Example (the quickstart's tokenizer)::

    python tools/train_tokenizer.py --input data/stdlib.jsonl --model-prefix data/stdlib_sp

Whitespace, indentation and newlines survive encode -> decode exactly; see docs/data.md.
"""

import argparse
import sys
import warnings

# Importing megatron.core warns about optional GPU kernels that data tools never use.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

from megatron_snip.cli import config_from_args  # noqa: E402 (after the filter)
from megatron_snip.data.tokenizer import (  # noqa: E402 (after the filter)
    BOS_ID,
    EOS_ID,
    MODEL_TYPES,
    PAD_ID,
    UNK_ID,
    TokenizerTrainingConfig,
    train_tokenizer,
)


def get_args(argv=None) -> argparse.Namespace:
    defaults = TokenizerTrainingConfig(input="", model_prefix="")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="JSONL (*.jsonl, *.json) or text file")
    parser.add_argument(
        "--json-keys", nargs="+", default=list(defaults.json_keys), help="JSONL keys to train on"
    )
    parser.add_argument(
        "--model-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab"
    )
    parser.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    parser.add_argument("--model-type", choices=MODEL_TYPES, default=defaults.model_type)
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=defaults.character_coverage,
        help="share of characters given their own piece; the rest use byte fallback",
    )
    parser.add_argument(
        "--input-sentence-size",
        type=int,
        default=defaults.input_sentence_size,
        help="train on a seeded random sample of this many lines (0: all lines)",
    )
    parser.add_argument(
        "--max-sentence-length",
        type=int,
        default=defaults.max_sentence_length,
        help="lines longer than this many bytes are skipped",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="seed of the line sample")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = get_args(argv)
    try:
        s = train_tokenizer(config_from_args(TokenizerTrainingConfig, args))
    except (FileNotFoundError, ValueError) as e:  # input problems: the message says it all
        sys.exit(f"train_tokenizer.py: error: {e}")
    print(
        f"Wrote {s.model_file}: {args.model_type}, vocab {s.vocab_size} "
        f"(pad {PAD_ID}, unk {UNK_ID}, bos {BOS_ID}, eos/eod {EOS_ID}); "
        f"trained on {s.documents} documents, {s.sentences} lines, {s.bytes / 1e6:.2f} MB; "
        f"{s.tokens} tokens, "
        f"{s.bytes_per_token:.2f} bytes/token; round-trip failures: {s.roundtrip_failures}; "
        f"{s.seconds:.2f} s"
    )
    if s.roundtrip_failures:
        sys.exit(f"train_tokenizer.py: error: {s.roundtrip_failures} documents do not survive encode -> decode")


if __name__ == "__main__":
    main()
