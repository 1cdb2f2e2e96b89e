"""Convert between Hugging Face Llama directories and megatron-snip checkpoints.

    python tools/convert_hf_llama.py import --load-dir HF_DIR --save-dir CKPT_DIR
    python tools/convert_hf_llama.py export --load-dir CKPT_DIR --save-dir HF_DIR [--dtype bf16]

Import writes iteration 0 of a model-only checkpoint that ``pretrain_llama.py --load CKPT_DIR``
loads in any TP x PP x DP layout (the shape flags come from it). Export writes config.json,
generation_config.json, safetensors shards with an index, the tokenizer files when known and
the SNIP plan as a side file (megatron_snip.json). Runs on the CPU. See docs/hf_interop.md.
"""

import argparse
import os
import sys

# Conversion runs in one CPU process whatever the machine has (a 70B model does not fit a GPU).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Like Megatron-LM's tools: runnable from a checkout without `pip install -e .`.

def get_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="direction", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> checkpoint")
    imp.add_argument("--load-dir", required=True, help="Hugging Face LlamaForCausalLM directory (safetensors)")
    imp.add_argument("--save-dir", required=True, help="checkpoint directory to write (iteration 0)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="pad the vocabulary to a multiple of this (Megatron's flag; the checkpoint then loads "
                          "at every TP size dividing the padded size)")
    imp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                     help="dtype of the checkpoint's weights (fp32, default: exact for any dtype the Hugging Face "
                          "files hold; bf16: half the size, the weights rounded to bf16 once)")
    exp = sub.add_parser("export", help="checkpoint -> Hugging Face directory")
    exp.add_argument("--load-dir", required=True, help="checkpoint directory (its newest iteration is exported)")
    exp.add_argument("--save-dir", required=True, help="Hugging Face directory to write")
    exp.add_argument("--dtype", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
                     help="dtype of the written weights (auto: the checkpoint's)")
    exp.add_argument("--max-shard-size-gb", type=float, default=2.0,
                     help="largest safetensors shard (export holds the model and one shard in memory)")
    for p in (imp, exp):
        p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = get_args(argv)
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    from megatron_snip.interop import hf_llama
    from megatron_snip.training.checkpointing import CheckpointError

    try:
        if args.direction == "import":
            s = hf_llama.import_hf(args.load_dir, args.save_dir, args.make_vocab_size_divisible_by, args.dtype,
                                   progress=not args.no_progress)
            print(f"imported {s.parameters / 1e6:.1f}M parameters from {s.source} into {s.destination} in "
                  f"{s.seconds:.1f} s; train with pretrain_llama.py --pretrained-checkpoint {s.destination} --load RUN "
                  f"--save RUN (or --load {s.destination} --finetune)")
        else:
            s = hf_llama.export_hf(args.load_dir, args.save_dir, args.dtype, int(args.max_shard_size_gb * 2**30),
                                   progress=not args.no_progress)
            print(f"exported {s.parameters / 1e6:.1f}M parameters from {s.source} into {s.destination} in "
                  f"{s.seconds:.1f} s")
    except (ValueError, FileNotFoundError, FileExistsError, CheckpointError) as e:
        print(f"convert_hf_llama.py: error: {e}", file=sys.stderr)
        return 2
    return 0


# dist_checkpointing's 'spawn' workers re-import __main__.
if __name__ == "__main__":
    sys.exit(main())
