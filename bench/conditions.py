"""The conditions a timed training step ran under, one definition for both sides of every comparison.

Our trainer's step (bench/step_time.py) and the plain-PyTorch peer's (bench/peer_step.py) are
only comparable when they ran under the same conditions: the same device, the same number of
processes with the same torch threads each, the same compute dtype, compile setting and
recomputation, the same model, batch and sequence (so the same FLOPs). A 2-core CPU showed what
happens otherwise: workers launched with ``OMP_NUM_THREADS=1`` against a peer on the machine's 2
threads made our step look 1.69x the peer's when, profiled in one process under the same threads,
the two were at parity (notes/step-vs-peer-on-cpu.md).

So both scripts take the same ``--threads`` (default: :func:`threads_per_process`, the cores
shared evenly by the processes), record the :class:`Conditions` they *measured* in their result
JSON, and bench/side_by_side.py refuses a ratio whose two sides' conditions differ
(:func:`differences`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields

COMPILE_EAGER = "eager"
NOT_RECORDED = "conditions not recorded"


@dataclass(frozen=True)
class Conditions:
    """What a timed step ran under.

    Attributes:
        device: the CUDA device's name, or ``cpu``.
        processes: processes the step runs in (ranks).
        threads_per_process: torch's intra-op threads in each, as measured there (``torch.get_num_threads()``).
        dtype: the compute dtype of the step's matmuls: ``bf16`` or ``fp32``.
        compile: ``eager``, or the ``torch.compile`` backend of the transformer blocks.
        recompute: activation recomputation: ``none``, ``full`` or ``selective``.
        model: the model's shape (:func:`model_label`).
        seq_length: tokens per sequence.
        micro_batch_size: sequences per micro-batch.
        num_microbatches: micro-batches per iteration (per data-parallel rank).
        flops_per_iteration: model FLOPs of one iteration, the project's formula
            (``megatron_snip.model.llama.flops_per_token``).
    """

    device: str
    processes: int
    threads_per_process: int
    dtype: str
    compile: str
    recompute: str
    model: str
    seq_length: int
    micro_batch_size: int
    num_microbatches: int
    flops_per_iteration: float

    def to_dict(self) -> dict:
        return asdict(self)


FIELDS = tuple(f.name for f in fields(Conditions))


def model_label(num_layers: int, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int,
                num_query_groups: int, vocab_size: int) -> str:
    """A model's shape in one string, spelled alike by both sides."""
    return (f"{num_layers} layers x {hidden_size}, ffn {ffn_hidden_size}, {num_attention_heads} heads / "
            f"{num_query_groups} groups, vocab {vocab_size}")


def device_label() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0))


def threads_per_process(processes: int, threads: int | None = None) -> int:
    """``threads`` (``--threads``) when given, else the cores shared evenly by ``processes`` (at least 1)."""
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads {threads}: at least 1")
        return threads
    return max(1, cores() // processes)


def worker_env(processes: int, threads: int | None = None, env: dict | None = None) -> dict:
    """The environment for ``processes`` worker processes: each gets :func:`threads_per_process` threads
    (torch reads ``OMP_NUM_THREADS`` at its start; torchrun would otherwise set 1 for several workers)."""
    return {**(os.environ if env is None else env), "OMP_NUM_THREADS": str(threads_per_process(processes, threads))}


def add_args(p: argparse.ArgumentParser) -> None:
    """The condition flags every step-timing bench takes alike."""
    p.add_argument("--threads", type=_at_least_one, default=None,
                   help="torch threads per process (default: this machine's cores shared evenly by the processes); "
                        "both sides of a comparison must run with the same")
    p.add_argument("--bf16", action="store_true", help="bf16 compute (default: fp32)")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: at least 1 thread per process")
    return value


def differences(a: dict | None, b: dict | None, by_design: tuple[str, ...] = ()) -> list[str]:
    """How the conditions ``a`` and ``b`` (:meth:`Conditions.to_dict`, as a result JSON records them)
    differ, one ``"field: A vs B"`` per field, the fields in ``by_design`` left out (those a comparison
    names, such as our eager step against the peer's compiled one); empty when they agree. A side that
    recorded no conditions differs from everything."""
    if not a or not b:
        return [f"{NOT_RECORDED} by " + ("either side" if not a and not b else "the first side" if not a
                                          else "the second side")]
    return [f"{name}: {_show(a.get(name))} vs {_show(b.get(name))}" for name in FIELDS
            if name not in by_design and a.get(name) != b.get(name)]


def _show(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)
