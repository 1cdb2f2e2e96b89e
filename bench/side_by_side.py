"""Our trainer beside the plain-PyTorch peer, shape by shape: the ratios the speed goals are set on.

bench/gpu_suite.py times, at each of SHAPES, the peer (bench/peer_step.py: eager, compiled per
block, torchao float8) and our trainer (bench/step_time.py: bf16 beside the plain megatron-core
loop, FP8 per recipe, a SNIP cycle) in the same run on the same GPU; :func:`side_by_side` reads
both results and gives the comparison lines and the goals:

- our bf16 step / the peer's compiled step <= 1.10 at every shape (issue 44);
- at four Llama-3-8B layers, our FP8 tensorwise step at least 1.15x faster than our bf16 step;
  at TinyLlama, our best FP8 recipe's step at most 1.2x our bf16 step (issue 45).

Our trainer's own goals (against the plain loop, the SNIP cycle) are bench/step_time.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from results import goal


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


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def _mfu(mfu: float | None) -> str:
    return "" if mfu is None else f", MFU {mfu:.3f}"


def side_by_side(results: dict[str, dict]) -> tuple[list[str], list[dict]]:
    """Comparison lines and goals from the results of the ``peer_SHAPE`` and ``ours_SHAPE`` steps
    (step name -> the JSON the benchmark wrote); shapes with neither are left out."""
    lines, goals = [], []
    for shape in SHAPES:
        peer, ours = results.get(f"peer_{shape.name}"), results.get(f"ours_{shape.name}")
        if not peer and not ours:
            continue
        lines.append(f"{shape.label}, 8 micro-batches of 1 per iteration:")
        variants = (peer or {}).get("variants", {})
        for name, v in variants.items():
            if "skipped" in v:
                lines.append(f"  peer {name:<20} skipped: {v['skipped']}")
            else:
                lines.append(f"  peer {name:<20} {_ms(v['seconds'])}, {v['tflops']:6.1f} TFLOP/s{_mfu(v['mfu'])}")
        compiled = variants.get("compiled", {}).get("seconds")
        for name, v in variants.items():
            if name.startswith("float8-") and "seconds" in v and compiled:
                lines.append(f"  peer torchao {name} speed-up over its compiled bf16: {compiled / v['seconds']:.3f}x")
        if ours:
            steps = ours["seconds_per_iteration"]
            bf16 = steps["ours"]
            lines.append(f"  ours plain megatron-core loop {_ms(steps['plain'])}")
            lines.append(f"  ours bf16 trainer             {_ms(bf16)}, {ours['bf16_tflops_per_device']:6.1f} "
                         f"TFLOP/s{_mfu(ours['mfu_bf16'])}; / plain loop {bf16 / steps['plain']:.3f}")
            for recipe, ratio in ours.get("fp8_vs_bf16", {}).items():
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
            fp8 = ours.get("fp8_vs_bf16", {})
            if shape.name in FP8_SPEEDUP_GOAL:
                speedup = 1 / fp8["tensorwise"] if "tensorwise" in fp8 else None
                goals.append(goal(f"{shape.name}: our fp8 tensorwise speed-up over our bf16", speedup,
                                  at_least=FP8_SPEEDUP_GOAL[shape.name]))
            if shape.name in FP8_SLOWDOWN_GOAL:
                goals.append(goal(f"{shape.name}: our best fp8 step / our bf16 step", min(fp8.values(), default=None),
                                  at_most=FP8_SLOWDOWN_GOAL[shape.name]))
        if ours and compiled:
            ratio = ours["seconds_per_iteration"]["ours"] / compiled
            lines.append(f"  ours bf16 / peer compiled: {ratio:.3f} (goal <= {PEER_GOAL:g})"
                         + (f"; / peer eager {ours['seconds_per_iteration']['ours'] / variants['eager']['seconds']:.3f}"
                            if "seconds" in variants.get("eager", {}) else ""))
            goals.append(goal(f"{shape.name}: our bf16 step / the peer's compiled step", ratio, at_most=PEER_GOAL))
    return lines, goals
