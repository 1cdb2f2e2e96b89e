"""Shared fixtures: a small real dataset, and launching pretrain_llama.py under torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    # Without a GPU, the Triton kernels' tests (test_triton_qdq.py) run them in Triton's
    # interpreter. Triton reads this when it is imported (megatron-core imports it) and when
    # a kernel launches, so it is set before anything else; nothing else launches kernels on CPU.
    os.environ["TRITON_INTERPRET"] = "1"


@dataclass(frozen=True)
class TinyData:
    prefix: str          # --data-path
    tokenizer_model: str  # --tokenizer-model
    corpus: str


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    """~60 stdlib modules, a 1024-piece tokenizer and the indexed dataset (built once per session)."""
    from megatron_snip.data.corpus import CorpusConfig, build_corpus
    from megatron_snip.data.datasets import PreprocessConfig, preprocess
    from megatron_snip.data.tokenizer import TokenizerTrainingConfig, train_tokenizer

    d = tmp_path_factory.mktemp("tiny_data")
    corpus = str(d / "corpus.jsonl")
    build_corpus(CorpusConfig(output=corpus, max_docs=60, exclude_tests=True, seed=1))
    train_tokenizer(TokenizerTrainingConfig(input=corpus, model_prefix=str(d / "tok"), vocab_size=1024))
    summary = preprocess(PreprocessConfig(input=corpus, output_prefix=str(d / "data"),
                                          tokenizer_model=str(d / "tok.model"), append_eod=True, progress=False))
    return TinyData(summary.prefixes["text"], str(d / "tok.model"), corpus)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A small Llama that runs a step in well under a second on 2 cores at any layout.
TINY_MODEL = ["--model-preset", "tiny", "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "192",
              "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "64",
              "--max-position-embeddings", "64"]


def train_args(data: TinyData, *extra: str, iters: int = 6) -> list[str]:
    """Arguments of a short deterministic run on ``data`` (logs every iteration)."""
    return [*TINY_MODEL, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-2", "--lr-warmup-iters", "1", "--seed", "7",
            "--data-path", data.prefix, "--split", "90,10,0", "--tokenizer-model", data.tokenizer_model,
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "2", *extra]


def torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True,
             env: dict | None = None, script: Path = ROOT / "pretrain_llama.py") -> subprocess.CompletedProcess:
    """Run pretrain_llama.py (or a driver ``script`` taking its flags) on ``nproc`` local processes;
    raise with the output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
                             f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc


def scalars(tensorboard_dir: str | Path, tag: str) -> dict[int, float]:
    """step -> value of one TensorBoard scalar tag (as the user's TensorBoard would show it)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for run in sorted(Path(tensorboard_dir).glob("**/events.out.tfevents.*")):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values.update({e.step: e.value for e in acc.Scalars(tag)})
    return values


@pytest.fixture(scope="session")
def init_ckpt(tiny_data, tmp_path_factory) -> Path:
    """Initial weights saved by a TP1 PP1 run that trains 0 iterations."""
    path = tmp_path_factory.mktemp("init") / "ckpt"
    torchrun(1, train_args(tiny_data, "--save", str(path), iters=0))
    return path
