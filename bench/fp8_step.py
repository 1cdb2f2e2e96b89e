"""Our FP8 training step in each recipe against our BF16 step, and the measured GEMM speed table.

    python bench/fp8_step.py                      # TP=2 PP=2 on 4 local processes (CPU here: FP8 emulated)
    python bench/fp8_step.py --nproc 1 --tp 1 --pp 1 --preset tinyllama-1.1b --bf16 \\
        --micro-batch-size 1 --global-batch-size 8 --iters 8 --warmup 3          # one GPU, the issue's shape
    python bench/fp8_step.py ... --recipes tensorwise rowwise --json out.json

One ``torchrun`` launch builds the model once (``pretrain_llama.py``'s own trainer, ``Trainer.train()``
end to end), then runs ``--iters`` steps per phase (the first ``--warmup`` untimed): all-bf16, then
every linear in fp8 under each ``--recipes`` recipe (``--fp8-recipe``; the layers' recipe swapped in
place), and prints each phase's median step as a ratio to the bf16 step. Goals (issue 45, on an
H100/H200): at the TinyLlama-1.1B shape the best recipe's step <= 1.2x the bf16 step; at four
Llama-3-8B layers (``--preset llama3-8b --num-layers 4 --seq-length 4096``) tensorwise <= 1 / 1.15.

It also prints the speed table the run measured at start-up (``--gemm-speed-model measured``: each
module type's forward and backward per precision, relative to bf16) and, per recipe, the step time
that table predicts: the bf16 step minus the GEMM time fp8 saves by the table (its seconds for one
micro-batch of each module type, times the layers on this rank and the micro-batches per step).
``prediction error`` is that prediction against the measured fp8 step: the check that a plan's
reported GEMM time ratio holds on the step (goal: within 10%; on CPU, where the GEMMs are most of
the step, the relation is tight; on a GPU the rest of the step dilutes it). Each process runs
``--threads`` torch threads (default: the cores shared evenly by ``--nproc``); the JSON records the
conditions the steps ran under (bench/conditions.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results import goal, write_json
from timing import device_name

ROOT = Path(__file__).resolve().parents[1]
WORKER = "--worker"
# The recipes with real kernels on Hopper (blockwise: where torch's block-scaled GEMM passes its first-use
# check; needs TP slices of whole 128-blocks, so not the default at the CPU layout TP=2 of the tiny preset).
RECIPES = ("tensorwise", "rowwise")


def worker(plan_file: str, argv: list[str]) -> None:
    """Inside torchrun: the phases on this rank; rank 0 writes what it measured."""
    from step_time import run_conditions, stamped_trainer

    run, trainer, clock = stamped_trainer(plan_file, argv)
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from megatron_snip.compat.device import current_device
    from megatron_snip.precision.gemm_speed import time_linears
    from megatron_snip.precision.plan import PrecisionPlan
    from megatron_snip.training.precision_setup import linear_shapes

    config = trainer.config
    shapes = linear_shapes(config, trainer.linear_dims)
    layers = len(trainer.precision.module_names()) // 4  # this rank's layers (4 linears each)
    model = trainer.speed_model
    result = {"device": device_name(), "conditions": run_conditions(trainer).to_dict(),
              "speed_model": model.describe(), "phases": {}, "recipes": {},
              "modules": {m: {p: list(v) for p, v in row.items()} for m, row in (model.module_speeds() or {}).items()},
              "micro_batches": config.training.num_microbatches, "layers_on_rank": layers}
    for name, recipe in [("bf16", None)] + [(f"fp8-{r}", r) for r in run["recipes"]]:
        base = config.precision.recipe()
        fp8_recipe = replace(base, fp8_recipe=recipe) if recipe else base
        trainer.precision.set_recipe(fp8_recipe)
        trainer.set_plan(PrecisionPlan.uniform("fp8" if recipe else "bf16"))
        clock.clear()
        trainer.train(until=trainer.state.iteration + run["iters"])
        result["phases"][name] = statistics.median(clock.intervals(run["warmup"]))
        if recipe:  # the table's GEMM seconds for one micro-batch, this recipe against bf16
            times = time_linears(shapes, fp8_recipe, device=current_device(), dtype=config.model.params_dtype,
                                 names=("bf16", "fp8"))
            per_step = layers * config.training.num_microbatches
            result["recipes"][recipe] = {p: per_step * sum(sum(row[p]) for row in times.values())
                                         for p in ("bf16", "fp8")}
    from megatron_snip.numerics.fp8_gemm import blockwise_layouts

    result["blockwise_layouts"] = {str(k[:4]): v for k, v in blockwise_layouts().items()}  # None: emulated
    if dist.get_rank() == 0:
        Path(run["out"]).write_text(json.dumps(result))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    dist.destroy_process_group()


def summarise(measured: dict) -> tuple[list[str], dict]:
    bf16 = measured["phases"]["bf16"]
    lines = [f"device: {measured['device']}", f"speed table: {measured['speed_model']}"]
    for module, row in measured["modules"].items():
        lines.append(f"  {module:28s} " + "  ".join(f"{p} fwd {f:.3g} bwd {b:.3g}" for p, (f, b) in row.items()))
    lines.append(f"our bf16 step: {bf16 * 1e3:.1f} ms")
    summary = {"bf16_ms": bf16 * 1e3, "recipes": {}, "conditions": measured.get("conditions")}
    for recipe, gemm in measured["recipes"].items():
        step = measured["phases"][f"fp8-{recipe}"]
        predicted = bf16 - gemm["bf16"] + gemm["fp8"]
        error = predicted / step - 1
        summary["recipes"][recipe] = {"ms": step * 1e3, "vs_bf16": step / bf16,
                                      "gemm_ratio": gemm["fp8"] / gemm["bf16"], "predicted_ms": predicted * 1e3,
                                      "prediction_error": error}
        lines.append(f"our fp8 ({recipe}) step: {step * 1e3:.1f} ms = {step / bf16:.3f} x bf16; table's GEMM time "
                     f"ratio {gemm['fp8'] / gemm['bf16']:.3f}, predicted step {predicted * 1e3:.1f} ms "
                     f"(prediction error {error:+.1%})")
    for shape, layouts in measured.get("blockwise_layouts", {}).items():
        lines.append(f"blockwise GEMM {shape}: " + ("emulated (torch's block-scaled GEMM did not agree or refused)"
                                                    if layouts is None else f"scale layouts {layouts}"))
    best = min((v["vs_bf16"] for v in summary["recipes"].values()), default=None)
    summary["goals"] = [goal("best fp8 recipe step / bf16 step", best, at_most=1.2)] + [
        goal(f"{r}: predicted / measured step - 1 (abs)", abs(v["prediction_error"]), at_most=0.10)
        for r, v in summary["recipes"].items()]
    return lines, summary


def main() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import conditions
    from step_time import add_layout_args, build_data, training_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layout_args(p)
    p.add_argument("--iters", type=int, default=10, help="steps per phase")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps of each phase")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=("tensorwise", "delayed", "rowwise",
                                                                            "blockwise", "mxfp8"))
    p.add_argument("--json", help="write the results here (for bench/gpu_suite.py)")
    opts, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        data = build_data(workdir, opts.data_dir)
        argv = training_args(opts, *data, (1 + len(opts.recipes)) * opts.iters) + extra
        out, plan = workdir / "measured.json", workdir / "phases.json"
        plan.write_text(json.dumps({"recipes": opts.recipes, "iters": opts.iters, "warmup": opts.warmup,
                                    "out": str(out)}))
        env = {**conditions.worker_env(opts.nproc, opts.threads), "MEGATRON_SNIP_CACHE": str(workdir / "cache")}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(opts.nproc),
                        __file__, WORKER, str(plan), *argv], check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        measured = json.loads(out.read_text())
    lines, summary = summarise(measured)
    print("\n".join(lines))
    write_json(opts.json, {**summary, "measured": measured})


if __name__ == "__main__":
    if sys.argv[1:2] == [WORKER]:
        sys.path.insert(0, str(ROOT / "bench"))
        worker(sys.argv[2], sys.argv[3:])
    else:
        main()
