"""What a checkpoint says about the run that saved it, for the conversions: its arguments and record.

Export (``hf_llama.py``) and the fp32-master extraction it launches (``dist_masters.py``) both rebuild
the saved run's model from these.
"""

from __future__ import annotations


def saved_args(load_dir: str) -> tuple[dict, dict]:
    """(arguments, replicated state) of the newest checkpoint in ``load_dir``, with the vocabulary
    sizes derived for checkpoints trained from scratch (they record the tokenizer, not the size)."""
    from megatron_snip.model.llama import padded_vocab_size
    from megatron_snip.training.checkpointing import read_record

    record = read_record(load_dir)
    if record is None:
        raise FileNotFoundError(f"--load-dir {load_dir} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    saved = dict(record.args)
    if saved.get("vocab_size") is None:
        from megatron_snip.data.tokenizer import build_tokenizer

        saved["vocab_size"] = build_tokenizer(saved["tokenizer_type"], saved["tokenizer_model"]).vocab_size
    if saved.get("padded_vocab_size") is None:
        saved["padded_vocab_size"] = padded_vocab_size(saved["vocab_size"], saved["make_vocab_size_divisible_by"],
                                                       saved["tensor_model_parallel_size"])
    return saved, record
