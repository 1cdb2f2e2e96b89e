"""Step time of our training loop vs a minimal plain megatron-core loop, same model and layout.

    python bench/step_time.py                       # TP=2 PP=2 on 4 local processes (CPU here)
    python bench/step_time.py --nproc 8 --tp 2 --pp 1 --preset tinyllama-1.1b --bf16   # a GPU node

    python bench/step_time.py --compare-precision nvfp4 mxfp4 fp8   # + emulated precisions vs bf16
    python bench/step_time.py --health-overhead nvfp4          # + --quant-health on vs off

Prints the median seconds per iteration of each and the ratio ours / plain
(goal: < 1.03), and for each ``--precision`` the ratio of our step time with
every linear module in that precision to our bf16 step time. (Options this
script does not know pass through to pretrain_llama.py, e.g. ``--num-workers 0``.) "ours" is ``Trainer.train()`` end to end (real data loader,
loss reporting, logging, the preemption check); "plain" is the textbook
megatron-core loop (forward_backward_func + optimizer.step) on in-memory
random tokens. Both build the model from the same arguments. Each mode runs
``--repeats`` times, alternating, and the best median is kept, because other
processes on the machine add noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEALTH_LOG_INTERVAL = 10
sys.path.insert(0, str(ROOT))


def training_args(opts, data_prefix: str, tokenizer_model: str, iters: int) -> list[str]:
    args = ["--model-preset", opts.preset, "--tensor-model-parallel-size", str(opts.tp),
            "--pipeline-model-parallel-size", str(opts.pp), "--micro-batch-size", str(opts.micro_batch_size),
            "--global-batch-size", str(opts.global_batch_size), "--train-iters", str(iters),
            "--data-path", data_prefix, "--tokenizer-model", tokenizer_model, "--split", "99,1,0",
            "--eval-iters", "0", "--eval-interval", "1000000", "--log-interval", "1000000", "--lr", "1e-4"]
    return args + (["--bf16"] if opts.bf16 else [])


def worker(mode: str, argv: list[str], warmup: int, out: str) -> None:
    """Runs inside torchrun: per-iteration times of one loop, after ``warmup`` iterations."""
    from megatron_snip.compat.cpu import silence_cpu_warnings

    silence_cpu_warnings()
    import torch
    import torch.distributed as dist

    from megatron_snip.arguments import parse_args
    from megatron_snip.training.logger import setup_console
    from megatron_snip.training.setup import initialize_distributed
    from megatron_snip.training.trainer import Trainer

    args = parse_args(argv)
    setup_console()
    initialize_distributed(args)
    trainer = Trainer(args)
    stamps: list[float] = []
    if mode == "ours":
        # Start-to-start time of consecutive steps: the whole loop body, data and checks included.
        step = trainer.train_step

        def stamped_step(data):
            stamps.append(time.perf_counter())
            return step(data)

        trainer.train_step = stamped_step
        trainer.train()
    else:
        plain_loop(trainer, args, stamps, torch)
    times = [b - a for a, b in zip(stamps, stamps[1:])][warmup:]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def plain_loop(trainer, args, stamps: list[float], torch) -> None:
    """The minimal megatron-core loop on the trainer's model/optimizer, random in-memory tokens."""
    vocab = trainer.tokenizer.vocab_size
    mbs, seq = args.micro_batch_size, args.seq_length
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, vocab, (mbs, seq + 1), device=device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mbs, -1)

    def forward_step(data_iterator, model):
        out = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {})

    for _ in range(args.train_iters):
        stamps.append(time.perf_counter())
        for chunk in trainer.model:
            chunk.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        trainer.forward_backward(forward_step_func=forward_step, data_iterator=None, model=trainer.model,
                                 num_microbatches=args.num_microbatches, seq_length=seq, micro_batch_size=mbs)
        trainer.optimizer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    stamps.append(time.perf_counter())


def build_data(workdir: Path) -> tuple[str, str]:
    from megatron_snip.data.corpus import CorpusConfig, build_corpus
    from megatron_snip.data.datasets import PreprocessConfig, preprocess
    from megatron_snip.data.tokenizer import TokenizerTrainingConfig, train_tokenizer

    corpus = str(workdir / "corpus.jsonl")
    build_corpus(CorpusConfig(output=corpus, max_bytes=1_000_000, exclude_tests=True))
    train_tokenizer(TokenizerTrainingConfig(input=corpus, model_prefix=str(workdir / "tok"), vocab_size=2048))
    summary = preprocess(PreprocessConfig(input=corpus, output_prefix=str(workdir / "data"),
                                          tokenizer_model=str(workdir / "tok.model"), append_eod=True,
                                          progress=False))
    return summary.prefixes["text"], str(workdir / "tok.model")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """The model and layout options every bench here shares."""
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--bf16", action="store_true")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layout_args(p)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--compare-precision", nargs="*", default=[], choices=["fp8", "nvfp4", "mxfp4"],
                   help="also time uniform precisions, as a ratio to bf16")
    p.add_argument("--health-overhead", metavar="PRECISION", choices=["fp8", "nvfp4", "mxfp4"], default=None,
                   help="also time uniform PRECISION with --quant-health and --no-quant-health at --log-interval "
                        f"{HEALTH_LOG_INTERVAL} (health is measured in full on logged steps, so these two runs "
                        "compare the mean, not the median, step time)")
    p.add_argument("--worker", choices=["ours", "plain"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    opts, rest = p.parse_known_args()
    if opts.worker:
        worker(opts.worker, rest, opts.warmup, opts.out)
        return

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        prefix, tok = build_data(workdir)
        argv = training_args(opts, prefix, tok, opts.iters) + rest
        runs = {"plain": ("plain", []), "ours": ("ours", [])}
        runs.update({p: ("ours", ["--precision", p]) for p in opts.compare_precision})
        health = opts.health_overhead
        if health:
            for on in ("quant-health", "no-quant-health"):
                runs[on] = ("ours", ["--precision", health, f"--{on}", "--log-interval", str(HEALTH_LOG_INTERVAL)])
        best: dict[str, float] = {}
        for repeat in range(opts.repeats):
            for name, (mode, extra) in runs.items():
                out = workdir / f"{name}{repeat}.json"
                subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc),
                                __file__, "--worker", mode, "--warmup", str(opts.warmup), "--out", str(out),
                                *argv, *extra],
                               check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                               stdout=subprocess.DEVNULL)
                typical = statistics.fmean if name.endswith("quant-health") else statistics.median
                seconds = typical(json.loads(out.read_text()))
                best[name] = min(best.get(name, float("inf")), seconds)
    print(f"layout TP={opts.tp} PP={opts.pp} DP={opts.nproc // (opts.tp * opts.pp)}, preset {opts.preset}, "
          f"global batch {opts.global_batch_size}, {opts.iters - opts.warmup} timed iterations x {opts.repeats}")
    print(f"plain megatron-core loop : {best['plain'] * 1e3:8.1f} ms/iteration")
    print(f"megatron-snip trainer    : {best['ours'] * 1e3:8.1f} ms/iteration")
    print(f"ratio ours / plain       : {best['ours'] / best['plain']:8.3f}")
    for p in opts.compare_precision:
        print(f"uniform {p:<6} (emulated): {best[p] * 1e3:8.1f} ms/iteration, ratio to bf16 {best[p] / best['ours']:.3f}")
    if health:
        on, off = best["quant-health"], best["no-quant-health"]
        print(f"{health} --quant-health (mean, log every {HEALTH_LOG_INTERVAL}): {on * 1e3:.1f} vs {off * 1e3:.1f} "
              f"ms/iteration off, ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
