"""Our model's forward + backward beside the plain-PyTorch peer's, in one process, alternating, same threads.

    python bench/fwd_bwd_side_by_side.py                       # negligible compute: host cost (22 x 64, seq 32)
    python bench/fwd_bwd_side_by_side.py --preset tinyllama-1.1b --num-layers 2 --seq-length 512 \\
        --runs 4 --warmup 2 --repeats 2                         # compute-dominated (TinyLlama dims, 2 layers)

One micro-batch (``--micro-batch-size`` sequences) forward and backward: ours is the project's model as
the trainer builds it (``trainer_from_command_line``: megatron-core's GPTModel in its DDP wrapper, our
quantized linears, BF16 plan), the peer ``bench/peer_step.py``'s model at the same shape, both on the
same random tokens. Each ``--repeats`` round times ``--runs`` calls of each side in turn (after
``--warmup`` untimed ones) and takes the medians; the ratio ours / peer is printed per round, then its
median and range over the rounds (the spread: other work on the machine moves single figures), by the
wall clock and by the process's CPU time (with ``--threads 1``, what other jobs on a shared machine do
not stretch).

Two modes, in this order: ``eager`` (both as written), then ``compiled`` (our layers by
``--torch-compile``'s ``compile_layers``, in place, and the peer's blocks by ``torch.compile``,
torchtitan's per-block compile), with ``--backend`` (inductor). After each mode: dynamo's counters for
our layers (frames given up, graph breaks, graphs, recompiles), and with ``--count`` the torch-function
calls and aten operations of one micro-batch of each side (host work the compiler removes; aten
operations eager only). fp32 on a CPU (``--bf16``: BF16 autocast for the peer, ``--bf16`` for ours).

Goals (issue 57): at negligible compute ours <= 1.3x the peer eager and <= 1.2x compiled; at a
compute-dominated shape compiled <= 1.05x. On a CPU both sides run under the project's CUDA stand-in
(``compat/cpu.py``, a torch-function mode every call passes through; off on a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import conditions
import torch
import torch.nn.functional as F
from peer_step import SHAPE_OVERRIDES, PeerConfig
from peer_step import build as build_peer
from results import goal, write_json
from step_time import BENCH_VOCAB
from timing import synchronize

GOALS = {"eager": 1.3, "compiled": 1.2}  # ours / peer at negligible compute
COMPUTE_GOAL = 1.05  # compiled, compute-dominated
NEGLIGIBLE = {"preset": "tiny", "num_layers": 22, "hidden_size": 64, "ffn_hidden_size": 176, "num_attention_heads": 4,
              "num_query_groups": 2, "seq_length": 32}


def our_model(opts) -> torch.nn.Module:
    """The trainer's model chunk (DDP-wrapped) at the shape of ``opts``, in a world of one."""
    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    from megatron_snip.cli.pretrain import trainer_from_command_line

    shape = ["--model-preset", opts.preset, "--num-layers", str(opts.num_layers), "--seq-length", str(opts.seq_length),
             "--max-position-embeddings", str(opts.seq_length)]
    for name in SHAPE_OVERRIDES:
        if getattr(opts, name) is not None:
            shape += [f"--{name.replace('_', '-')}", str(getattr(opts, name))]
    argv = [*shape, "--micro-batch-size", str(opts.micro_batch_size), "--global-batch-size",
            str(opts.micro_batch_size), "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(BENCH_VOCAB - 1), "--eval-iters", "0", *(["--bf16"] if opts.bf16 else [])]
    trainer = trainer_from_command_line(argv)
    (model,) = trainer.model
    return model


class Calls(torch.overrides.TorchFunctionMode):
    """Counts torch-function calls (Python-level torch API calls) and, with :class:`Ops`, aten operations."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def sides(model, peer, tokens: torch.Tensor, bf16: bool) -> dict:
    """One micro-batch forward + backward of each side."""
    s = tokens.shape[1] - 1
    positions = torch.arange(s, device=tokens.device).expand(tokens.shape[0], s)

    def ours():
        model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean().backward()

    def theirs():
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = peer(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1)).backward()

    return {"ours": ours, "peer": theirs}


def time_round(fns: dict, runs: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds of each side, the sides alternating call by call. With one thread
    the CPU time is the work the call did, which other jobs on a shared machine do not stretch."""
    times = {name: ([], []) for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            synchronize(device)
            start, cpu = time.perf_counter(), time.process_time()
            fn()
            synchronize(device)
            times[name][0].append(time.perf_counter() - start)
            times[name][1].append(time.process_time() - cpu)
    return {name: (statistics.median(wall), statistics.median(cpu)) for name, (wall, cpu) in times.items()}


def counts(fn, aten: bool) -> tuple[int, int | None]:
    """torch-function calls of one ``fn()``, and with ``aten`` its aten operations (None: not counted; a
    dispatch mode would keep compiled code from running)."""
    calls, ops = Calls(), Ops()
    with calls, ops if aten else contextlib.nullcontext():
        fn()
    return calls.count, ops.count if aten else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default=None, help="a model preset (default: the negligible-compute shape)")
    p.add_argument("--num-layers", type=int)
    p.add_argument("--seq-length", type=int)
    for name in SHAPE_OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--runs", type=int, default=20, help="timed calls per side per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per side before the first round")
    p.add_argument("--repeats", type=int, default=3, help="rounds (the spread is over them)")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--backend", default="inductor", help="torch.compile backend of both sides")
    p.add_argument("--count", action="store_true", help="also count torch-function calls and aten ops per micro-batch")
    p.add_argument("--json", type=Path, help="also write the figures and goals here (bench/gpu_suite.py)")
    conditions.add_args(p)
    opts = p.parse_args()
    if opts.preset is None:  # the negligible-compute shape, flag by flag where not given
        for key, value in NEGLIGIBLE.items():
            if getattr(opts, key) is None:
                setattr(opts, key, value)
    preset = PeerConfig.from_preset(opts.preset).shape
    opts.num_layers = opts.num_layers or preset.num_layers
    opts.seq_length = opts.seq_length or preset.seq_length
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    torch.set_num_threads(conditions.threads_per_process(1, opts.threads))
    model = our_model(opts)
    torch.set_num_threads(conditions.threads_per_process(1, opts.threads))  # the trainer's set-up may change it
    device = next(model.parameters()).device
    config = PeerConfig.from_preset(opts.preset, opts.num_layers, opts.seq_length,
                                    micro_batch_size=opts.micro_batch_size, num_microbatches=1, bf16=opts.bf16,
                                    **{k: getattr(opts, k) for k in SHAPE_OVERRIDES})
    tokens = torch.randint(0, BENCH_VOCAB, (opts.micro_batch_size, opts.seq_length + 1),
                           generator=torch.Generator().manual_seed(0)).to(device)
    s = config.shape
    print(f"{s.num_layers} layers x {s.hidden_size} (ffn {s.ffn_hidden_size}, {s.num_attention_heads} heads, "
          f"{s.num_query_groups} groups), seq {s.seq_length}, micro-batch {opts.micro_batch_size}, "
          f"{'bf16' if opts.bf16 else 'fp32'}, {torch.get_num_threads()} threads, {conditions.device_label()}; "
          f"{opts.repeats} rounds of {opts.runs} calls per side", flush=True)
    figures, goals = {}, []
    negligible = opts.preset == NEGLIGIBLE["preset"]
    for mode in opts.modes:
        from torch._dynamo.utils import counters as dynamo_counters

        from megatron_snip.model.compile import compile_layers, counters

        if mode == "compiled":
            torch._dynamo.reset()
            dynamo_counters.clear()
            compile_layers([model.module], opts.backend)
        peer, _ = build_peer(config, "eager" if mode == "eager" else "compiled", device, opts.backend)
        fns = sides(model, peer, tokens, opts.bf16)
        for _ in range(opts.warmup):
            for fn in fns.values():
                fn()
        ours_counters = counters() if mode == "compiled" else None
        rounds = [time_round(fns, opts.runs, device) for _ in range(opts.repeats)]
        entry = {"counters": ours_counters}
        for k, clock in enumerate(("wall", "cpu")):
            ratios = [r["ours"][k] / r["peer"][k] for r in rounds]
            entry[clock] = {"ours_ms": [r["ours"][k] * 1e3 for r in rounds],
                            "peer_ms": [r["peer"][k] * 1e3 for r in rounds],
                            "ratios": ratios, "ratio": statistics.median(ratios)}
        bound = GOALS[mode] if negligible else (COMPUTE_GOAL if mode == "compiled" else None)
        for clock in ("wall", "cpu"):
            e = entry[clock]
            print(f"{mode:>8} {clock:>4}: ours {statistics.median(e['ours_ms']):8.1f} ms, peer "
                  f"{statistics.median(e['peer_ms']):8.1f} ms, ours / peer {e['ratio']:.2f} (rounds: "
                  f"{', '.join(f'{r:.2f}' for r in e['ratios'])})" + (f"; goal <= {bound}" if bound else ""),
                  flush=True)
        clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
        if bound:
            goals.append(goal(f"our {mode} forward+backward / the peer's ({clock} time)", entry[clock]["ratio"],
                              at_most=bound))
        if ours_counters is not None:
            print(f"          our layers under dynamo: {ours_counters}")
            goals += [goal(f"our compiled layers: {key.replace('_', ' ')}", ours_counters[key], at_most=0)
                      for key in ("frames_given_up", "graph_breaks", "recompiles")]
        if opts.count:
            entry["ours_calls"], entry["ours_ops"] = counts(fns["ours"], mode == "eager")
            entry["peer_calls"], entry["peer_ops"] = counts(fns["peer"], mode == "eager")
            print(f"          per micro-batch: torch-function calls ours {entry['ours_calls']} / peer "
                  f"{entry['peer_calls']}, aten ops ours {entry['ours_ops']} / peer {entry['peer_ops']}")
        figures[mode] = entry
        del peer, fns
        if {"eager", "compiled"} <= set(figures):  # does compile pay for our model? (the default's rule)
            pays = (statistics.median(figures["compiled"][clock]["ours_ms"])
                    / statistics.median(figures["eager"][clock]["ours_ms"]))
            print(f"our compiled / our eager: {pays:.2f} ({clock} time)")
            goals.append(goal(f"our compiled forward+backward / our eager ({clock} time): compile pays", pays,
                              at_most=1.0))
        write_json(opts.json, {"benchmark": "fwd_bwd_side_by_side", "device": conditions.device_label(),
                               "shape": {k: getattr(opts, k) for k in ("preset", "num_layers", "seq_length",
                                                                       *SHAPE_OVERRIDES, "micro_batch_size")},
                               "bf16": opts.bf16, "threads": torch.get_num_threads(), "figures": figures,
                               "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
