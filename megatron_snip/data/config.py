"""The run's data flags, validated once by ``megatron_snip.arguments``."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_snip.flags import flag, flag_values

# Megatron-LM's --tokenizer-type values read here: its three SentencePiece names read one .model file alike
# (megatron-core's tokenizers build all three from the same library), and NullTokenizer (no file).
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGINGFACE_TOKENIZER = "HuggingFaceTokenizer"
NULL_TOKENIZER = "NullTokenizer"
# Megatron-LM's other types, refused with what to use instead.
REFUSED_TOKENIZER_TYPES = {
    "TikTokenizer": "Llama 3's tiktoken vocabulary ships as a tokenizer.json: use --tokenizer-type "
                    "HuggingFaceTokenizer --tokenizer-model that file or its model directory",
    "GPT2BPETokenizer": "vocab.json + merges.txt files are not read here; use --tokenizer-type HuggingFaceTokenizer "
                        "with the model's tokenizer.json",
    "BertWordPieceLowerCase": "a BERT vocabulary is not a Llama tokenizer; use SentencePieceTokenizer or "
                              "HuggingFaceTokenizer",
    "BertWordPieceCase": "a BERT vocabulary is not a Llama tokenizer; use SentencePieceTokenizer or "
                         "HuggingFaceTokenizer",
    "MultimodalTokenizer": "multimodal training is not supported (text only)",
    "NullMultimodalTokenizer": "multimodal training is not supported (text only); use NullTokenizer",
    "SFTTokenizer": "supervised fine-tuning formats are not supported (pretraining only)",
}
TOKENIZER_TYPES = (*SENTENCEPIECE_TYPES, HUGGINGFACE_TOKENIZER, NULL_TOKENIZER)


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how samples are built (Megatron-LM's flags)."""

    # None only when launch scripts are checked without data.
    data_path: tuple[str, ...] | None = flag(
        None, "Prefix of a .bin/.idx pair, or a blend 'W1 PREFIX1 W2 PREFIX2 ...', split into train, valid and test "
        "documents by --split.")
    split: str | None = flag(
        None, "Train,valid,test proportions of --data-path's documents (default 969,30,1, Megatron-LM's). A "
        "validation share of 0 turns evaluation off (as in Megatron-LM: --eval-iters is then 0).")
    train_data_path: tuple[str, ...] | None = flag(
        None, "Instead of --data-path and --split: the training data alone (a prefix or a blend, as --data-path).")
    valid_data_path: tuple[str, ...] | None = flag(
        None, "With --train-data-path: the validation data (none: no evaluation, --eval-iters is then 0).")
    test_data_path: tuple[str, ...] | None = flag(None, "With --train-data-path: the test data.")
    data_args_path: str | None = flag(
        None, "Instead of --data-path: a text file holding its value (prefixes, or weights and prefixes, separated by "
        "whitespace), for a blend too long for a command line. Read at start-up.")
    per_split_data_args_path: str | None = flag(
        None, "Instead of --train-data-path, --valid-data-path and --test-data-path: a JSON file with the keys train, "
        "valid and test, each a list of such a flag's values or one string of them (empty: no such split). Read at "
        "start-up.")
    mock_data: bool = flag(
        False, "Synthetic data instead of --data-path: megatron-core's MockGPTDataset (documents of random length, "
        "each 1, 2, 3, ... modulo the vocabulary, then end-of-document), split 1,1,1 whatever --split says, as in "
        "Megatron-LM. Usually with --tokenizer-type NullTokenizer --vocab-size N.")
    tokenizer_type: str = flag(
        "SentencePieceTokenizer", "SentencePieceTokenizer, GPTSentencePieceTokenizer or Llama2Tokenizer (a "
        "SentencePiece .model file: TinyLlama, Llama 2), HuggingFaceTokenizer (a tokenizer.json, or the model "
        "directory holding it: Llama 3), or NullTokenizer (no file: --vocab-size N ids and the end-of-document id N, "
        "for --mock-data). Megatron-LM's other types are refused.",
        choices=(*TOKENIZER_TYPES, *REFUSED_TOKENIZER_TYPES))
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

    def file_values(self) -> dict:
        """The flag values a config file states: the paths a --data-args-path or --per-split-data-args-path file
        gave are left to the file (read again when the configuration is)."""
        values = flag_values(self)
        if self.data_args_path is not None:
            del values["data_path"]
        if self.per_split_data_args_path is not None:
            for key in ("train_data_path", "valid_data_path", "test_data_path"):
                del values[key]
        return values
