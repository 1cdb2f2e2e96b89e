"""Our trainer beside the plain-PyTorch peer, shape by shape: the ratios the speed goals are set on.

    python bench/side_by_side.py --preset tiny --num-layers 1 --hidden-size 1024 --ffn-hidden-size 2816 \\
        --num-attention-heads 8 --num-query-groups 4 --seq-length 64 --num-microbatches 4 \\
        --threads 1                 # anywhere: the same work on both sides (a CPU: fp32, ~30 s on 2 cores)
    python bench/side_by_side.py --preset tinyllama-1.1b --bf16   # a GPU: both sides at the suite's shape

Both sides run under one definition of the run's conditions (:class:`Run`: the shape, the batch,
the dtype, the torch threads per process, the timing), each in its own process:
bench/peer_step.py (the peer: eager, and on a GPU compiled per block) and bench/step_time.py (our
trainer and the plain megatron-core loop, one process), and each records the conditions it
measured (bench/conditions.py). :func:`compare` sets a ratio only between sides whose conditions
agree, and says loudly which differ where they do not: on a 2-core CPU, a thread count that
differed between the two sides alone once made our step look 1.69x the peer's at equal work.
bench/gpu_suite.py runs the two sides as separate steps (each with its own time cap) with the
commands :class:`Run` builds, and :func:`side_by_side` reads both results at each of SHAPES:

- our bf16 step / the peer's step under the same conditions (the same compile setting): the
  like-for-like ratio;
- our bf16 step / the peer's compiled step <= 1.10 at every shape (issue 44; the compile setting
  is the one condition this ratio lets differ, and it names both);
- at four Llama-3-8B layers, our FP8 tensorwise step at least 1.15x faster than our bf16 step;
  at TinyLlama, our best FP8 recipe's step at most 1.2x our bf16 step (issue 45).

Our trainer's own goals (against the plain loop, the SNIP cycle) are bench/step_time.py's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import conditions
from results import goal

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Shape:
    """A model shape every GPU run times, by our trainer and the peer alike.

    Attributes:
        name: in the steps' names (``peer_NAME``, ``ours_NAME``).
        label: for people.
        flags: the shape flags bench/step_time.py, bench/peer_step.py and bench/snip_cycle.py share.
    """

    name: str
    label: str
    flags: tuple[str, ...]


SHAPES = (
    Shape("tinyllama", "TinyLlama-1.1B (22 layers x 2048, seq 2048)", ("--preset", "tinyllama-1.1b")),
    Shape("llama3_8b_4l", "4 Llama-3-8B layers (4096, ffn 14336, seq 4096)",
          ("--preset", "llama3-8b", "--num-layers", "4", "--seq-length", "4096")),
)
PEER_GOAL = 1.10  # our bf16 step / the peer's compiled step
FP8_SPEEDUP_GOAL = {"llama3_8b_4l": 1.15}  # our bf16 step / our fp8 tensorwise step, at least
FP8_SLOWDOWN_GOAL = {"tinyllama": 1.2}  # our best fp8 step / our bf16 step, at most
# Shape flags both sides take over a preset's (bench/step_time.py passes those it does not know to pretrain_llama.py).
SHAPE_FLAGS = ("--num-layers", "--seq-length", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
               "--num-query-groups")


@dataclass(frozen=True)
class Run:
    """What both sides of a comparison take alike: the shape, the batch (``num_microbatches`` of
    ``micro_batch_size`` sequences, one process), the dtype, the torch threads of the process (None:
    all this machine's cores, bench/conditions.py) and the timing (``iters`` iterations, the first
    ``warmup`` untimed)."""

    shape: tuple[str, ...]
    micro_batch_size: int = 1
    num_microbatches: int = 8
    bf16: bool = True
    threads: int | None = None
    iters: int = 5
    warmup: int = 2

    def common(self) -> list[str]:
        """The flags both scripts take with one meaning, threads resolved here so both get the same number."""
        return [*self.shape, "--micro-batch-size", str(self.micro_batch_size),
                "--threads", str(conditions.threads_per_process(1, self.threads)),
                "--iters", str(self.iters), "--warmup", str(self.warmup), *(["--bf16"] if self.bf16 else [])]

    def peer(self, json_path: Path | str, *extra: str) -> list[str]:
        """bench/peer_step.py's command (``extra``: --variants, --profile, --backend ...)."""
        return [sys.executable, str(BENCH / "peer_step.py"), *self.common(),
                "--num-microbatches", str(self.num_microbatches), "--json", str(json_path), *extra]

    def ours(self, json_path: Path | str, *extra: str) -> list[str]:
        """bench/step_time.py's command on one process (``extra``: its phases, and flags for pretrain_llama.py)."""
        return [sys.executable, str(BENCH / "step_time.py"), *self.common(), "--nproc", "1", "--tp", "1", "--pp", "1",
                "--global-batch-size", str(self.micro_batch_size * self.num_microbatches),
                "--json", str(json_path), *extra]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def _mfu(mfu: float | None) -> str:
    return "" if mfu is None else f", MFU {mfu:.3f}"


def describe(c: dict | None) -> str:
    """Conditions in one line."""
    if not c:
        return conditions.NOT_RECORDED
    return (f"{c['device']}, {c['processes']} process(es) x {c['threads_per_process']} threads, {c['dtype']}, "
            f"{c['compile']}, recompute {c['recompute']}, {c['model']}, seq {c['seq_length']}, "
            f"{c['num_microbatches']} micro-batches of {c['micro_batch_size']}, "
            f"{c['flops_per_iteration'] / 1e12:.4g} TFLOP per iteration")


def peer_ratio(ours: dict, peer: dict, variant: str, by_design: tuple[str, ...] = ()) -> tuple[
        float | None, list[str], str]:
    """Our bf16 step over the peer's ``variant`` step: (the ratio, None where there is none or it is
    refused; the conditions that differ beyond ``by_design``; what to print of it)."""
    v = peer.get("variants", {}).get(variant, {})
    if "seconds" not in v:
        return None, [], f"no peer figure ({v.get('skipped', 'not run')})"
    theirs = v.get("conditions")
    differ = conditions.differences(ours.get("conditions"), theirs, by_design)
    if differ:
        return None, differ, "REFUSED, the two sides ran under different conditions: " + "; ".join(differ)
    named = "".join(f", {name}: ours {ours['conditions'][name]} / peer {theirs[name]}" for name in by_design
                    if ours["conditions"][name] != theirs[name])
    ratio = ours["seconds_per_iteration"]["ours"] / v["seconds"]
    return ratio, [], f"{ratio:.3f} (same conditions{named}){cpu_ratio(ours, v)}"


def cpu_ratio(ours: dict, peer_variant: dict) -> str:
    """On a CPU, our step over the peer's in process CPU time too: the two sides run one after the other,
    and other jobs on the machine stretch the wall time of each by what they take in its turn, not the
    CPU time it spends (with one thread per process, where no thread waits at a barrier for another)."""
    ours_cpu = ours.get("cpu_seconds_per_iteration", {}).get("ours")
    if ours["conditions"]["device"] != "cpu" or ours_cpu is None or "cpu_seconds" not in peer_variant:
        return ""
    return f"; in process CPU time {ours_cpu / peer_variant['cpu_seconds']:.3f}"


def compare(shape: Shape, peer: dict | None, ours: dict | None) -> tuple[list[str], list[dict]]:
    """Comparison lines and goals at ``shape`` from the peer's and our results (the JSON
    bench/peer_step.py and bench/step_time.py wrote; either may be None)."""
    lines, goals = [f"{shape.label}:"], []
    variants = (peer or {}).get("variants", {})
    for name, v in variants.items():
        if "skipped" in v:
            lines.append(f"  peer {name:<20} skipped: {v['skipped']}")
        else:
            lines.append(f"  peer {name:<20} {_ms(v['seconds'])}, {v['tflops']:6.3g} TFLOP/s{_mfu(v['mfu'])}")
    compiled = variants.get("compiled", {}).get("seconds")
    for name, v in variants.items():
        if name.startswith("float8-") and "seconds" in v and compiled:
            lines.append(f"  peer torchao {name} speed-up over its compiled bf16: {compiled / v['seconds']:.3f}x")
    steps = (ours or {}).get("seconds_per_iteration", {})
    dtype = ((ours or {}).get("conditions") or {}).get("dtype", "bf16")  # fp32 in a CPU run
    if "ours" in steps:
        bf16 = steps["ours"]
        lines.append(f"  ours plain megatron-core loop {_ms(steps['plain'])}")
        lines.append(f"  ours {dtype} trainer             {_ms(bf16)}, {ours['bf16_tflops_per_device']:6.3g} "
                     f"TFLOP/s{_mfu(ours['mfu_bf16'])}; / plain loop {bf16 / steps['plain']:.3f}")
        fp8 = ours.get("fp8_vs_bf16", {})
        for recipe, ratio in fp8.items():
            lines.append(f"  ours fp8 {recipe:<21} {_ms(ratio * bf16)}, / our bf16 {ratio:.3f} "
                         f"(speed-up {1 / ratio:.3f}x)")
        if "snip_cycle_bf16_iterations" in ours:
            lines.append(f"  ours SNIP cycle {ours['snip_cycle_seconds']:.2f} s = "
                         f"{ours['snip_cycle_bf16_iterations']:.1f} bf16 iterations"
                         + (f", peak memory {ours['snip_cycle_peak_vs_bf16_step']:.2f}x the bf16 step's"
                            if "snip_cycle_peak_vs_bf16_step" in ours else ""))
        if "snip_step_vs_bf16" in ours:
            lines.append(f"  ours SNIP time-target plan: step / bf16 {ours['snip_step_vs_bf16']:.3f}, logged "
                         f"time ratio {ours['snip_plan']['time_ratio']:.3f}")
        fp8_profiles = (f"ours_{shape.name}/fp8", f"ours_{shape.name}/ours")
        if shape.name in FP8_SPEEDUP_GOAL:
            speedup = 1 / fp8["tensorwise"] if "tensorwise" in fp8 else None
            goals.append(goal(f"{shape.name}: our fp8 tensorwise speed-up over our bf16", speedup,
                              at_least=FP8_SPEEDUP_GOAL[shape.name], profiles=fp8_profiles))
        if shape.name in FP8_SLOWDOWN_GOAL:
            goals.append(goal(f"{shape.name}: our best fp8 step / our bf16 step", min(fp8.values(), default=None),
                              at_most=FP8_SLOWDOWN_GOAL[shape.name], profiles=fp8_profiles))
    if "ours" in steps and variants:
        lines.append(f"  conditions, ours: {describe(ours.get('conditions'))}")
        compiled_ours = (ours.get("conditions") or {}).get("compile", conditions.COMPILE_EAGER)
        like = "eager" if compiled_ours == conditions.COMPILE_EAGER else "compiled"
        ratio, differ, text = peer_ratio(ours, peer, like)
        lines.append(f"  ours {dtype} / peer {like}: {text}")
        goals.append({**goal(f"{shape.name}: conditions that differ between our step and the peer's {like} step",
                             None if text.startswith("no peer figure") else len(differ), at_most=0),
                      **({"note": "; ".join(differ)} if differ else {})})
        if like != "compiled":  # the goal's ratio: the compile setting differs by design, and is named
            ratio, differ, text = peer_ratio(ours, peer, "compiled", by_design=("compile",))
            lines.append(f"  ours {dtype} / peer compiled (goal <= {PEER_GOAL:g}): {text}")
        goals.append({**goal(f"{shape.name}: our bf16 step / the peer's compiled step", ratio, at_most=PEER_GOAL,
                             profiles=(f"ours_{shape.name}/ours", f"peer_{shape.name}/compiled")),
                      **({"note": "refused: the conditions differ (" + "; ".join(differ) + ")"} if differ else {})})
    return lines, goals


def side_by_side(results: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """Comparison lines and goals from the results of the ``peer_SHAPE`` and ``ours_SHAPE`` steps
    (step name -> the JSON the benchmark wrote); shapes with neither are left out."""
    lines, goals = [], []
    for shape in SHAPES:
        peer, ours = results.get(f"peer_{shape.name}"), results.get(f"ours_{shape.name}")
        if peer or ours:
            more_lines, more_goals = compare(shape, peer, ours)
            lines += more_lines
            goals += more_goals
    return lines, goals


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tinyllama-1.1b")
    for flag in SHAPE_FLAGS:
        p.add_argument(flag, type=int, help="override the preset's (both sides)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=8)
    p.add_argument("--iters", type=int, default=5, help="iterations per timed phase, warm-up included")
    p.add_argument("--warmup", type=int, default=2, help="untimed first iterations of each phase")
    p.add_argument("--backend", default=None, help="the peer's torch.compile backend (default: inductor on a GPU; "
                                                   "on a CPU the peer runs eager only)")
    p.add_argument("--data-dir", type=Path, help="bench/step_time.py's data, built once and reused")
    p.add_argument("--json", type=Path, help="also write both sides' results and the comparison here")
    conditions.add_args(p)
    args, rest = p.parse_known_args()  # the rest: flags for pretrain_llama.py (our side)
    import torch

    shape = ["--preset", args.preset]
    for flag in SHAPE_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        shape += [flag, str(value)] if value is not None else []
    run = Run(tuple(shape), args.micro_batch_size, args.num_microbatches, args.bf16, args.threads, args.iters,
              args.warmup)
    cuda = torch.cuda.is_available()
    variants = ["eager", "compiled"] if cuda or args.backend else ["eager"]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        peer_cmd = run.peer(out / "peer.json", "--variants", *variants,
                            *(["--backend", args.backend] if args.backend else []))
        ours_cmd = run.ours(out / "ours.json", "--repeats", "1",
                            *(["--data-dir", str(args.data_dir)] if args.data_dir else []), *rest)
        for cmd in (peer_cmd, ours_cmd):
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        peer, ours = (json.loads((out / f"{side}.json").read_text()) for side in ("peer", "ours"))
    lines, goals = compare(Shape("run", " ".join(shape), tuple(shape)), peer, ours)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"peer": peer, "ours": ours, "lines": lines, "goals": goals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
