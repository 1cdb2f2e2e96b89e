"""The run's data flags, validated once by ``megatron_snip.arguments``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.flags import flag

TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how samples are built (Megatron-LM's flags)."""

    # None only when launch scripts are checked without data.
    data_path: tuple[str, ...] | None = flag(
        None, "Prefix of a .bin/.idx pair, or a blend 'W1 PREFIX1 W2 PREFIX2 ...'.")
    split: str = flag("969,30,1", "Train,valid,test proportions. A validation share of 0 turns evaluation off (as in "
                      "Megatron-LM: --eval-iters is then 0).")
    tokenizer_type: str = flag(
        "SentencePieceTokenizer", "SentencePieceTokenizer (a .model file: TinyLlama, Llama 2) or "
        "HuggingFaceTokenizer (a tokenizer.json, or the model directory holding it: Llama 3).",
        choices=TOKENIZER_TYPES)
    tokenizer_model: str | None = flag(None, "The tokenizer file (or, for HuggingFaceTokenizer, a model directory).")
    data_cache_path: str | None = flag(None, "Where megatron-core caches the dataset indices (default: beside the "
                                       "data).")
    num_workers: int | None = flag(
        None, "Data-loader worker processes per rank (0: load in the training process). Default: 2 with CUDA (as "
        "Megatron); 0 without, where workers would compete with training for cores.")
    reset_position_ids: bool = flag(False, "Restart position ids after each end-of-document token.")
    reset_attention_mask: bool = flag(False, "Mask attention across end-of-document tokens.")
    eod_mask_loss: bool = flag(False, "No loss on end-of-document tokens.")
    mmap_bin_files: bool = flag(True, "Read the .bin files without memory-mapping them.",
                                option="--no-mmap-bin-files")
