"""The arbiter of SNIP's estimators: estimates vs measured ground truth, as Spearman correlations.

    # a checkpoint of the quickstart (any layout; run with the flags it was trained with)
    torchrun --nproc-per-node 1 tools/lab/snip_validate.py $(cat runs/quickstart/flags) \\
        --load runs/quickstart/checkpoints
    # or a fresh model trained --train-iters steps first
    torchrun --nproc-per-node 1 tools/lab/snip_validate.py --data-path D --tokenizer-model T --train-iters 60 ...

Takes pretrain_llama.py's flags plus ``--validate-batches``, ``--validate-seeds`` and
``--output``. It runs one SNIP probe cycle on each of the next ``--validate-batches`` global batches (the
estimates, averaged over the batches the ground truth is measured on), then for
every (module, format) actually runs only that module in that format (the ground truth:
forward = the loss change with only that module's fprop quantized; backward = the drift of the
Adam-preconditioned update with only its dgrad/wgrad quantized), averaged over the batches and
rounding seeds, and prints the rank correlation of each estimator with its ground truth next
to the local quantization-error baselines (absolute ||E||^2 and relative ||E||^2/||Y||^2).

``--validate-by-type`` measures instead, per module type (every layer's qkv at once, ...), the
exact update drift of its backward GEMMs in each format, split into its own weights and the rest
next to SNIP's local and propagated parts, the drift its forward GEMMs cause (which SNIP's update
term leaves out), how much of each repeats between batches (whole, own weights, the rest),
which Adam's momentum keeps, and the drift and persistence of the input-gradient error that the
quantized weight alone causes in dgrad (``snip_lab.ground_truth.group_drift``; results/notebook.md, "Why SNIP ranks
qkv and fc1 above fc2").
It costs three forward + backward passes per (type, format, batch), where the per-module truth costs
one per (module, format, seed, batch): at 16 layers 64 modules against 4 types.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import islice
from pathlib import Path


def table(rows: dict[str, dict[str, float]], formats) -> str:
    cols = ["all", *formats]
    out = [f"{'estimate vs ground truth':<44}" + "".join(f"{c:>9}" for c in cols)]
    out += [f"{name:<44}" + "".join(f"{r.get(c, float('nan')):9.3f}" for c in cols) for name, r in rows.items()]
    return "\n".join(out)


def type_table(rows: dict[str, dict[str, float]]) -> str:
    cols = list(next(iter(rows.values())))
    out = [f"{'type':<14}" + "".join(f"{c:>17}" for c in cols)]
    out += [f"{t:<14}" + "".join(f"{r[c]:17.3g}" for c in cols) for t, r in rows.items()]
    return "\n".join(out)


def mean_tables(tables: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """module -> format -> the mean over ``tables`` (the same keys in each)."""
    return {m: {f: sum(t[m][f] for t in tables) / len(tables) for f in row} for m, row in tables[0].items()}


def by_type(trainer, cycles, per_batch, batches, formats, seed: int) -> dict[str, dict[str, dict[str, float]]]:
    """format -> module type -> SNIP's update terms (the mean over the batches' probe cycles, ``cycles``
    and their divergences ``per_batch``) and the measured drifts (``--validate-by-type``)."""
    from megatron_snip.numerics.recipes import Precision
    from snip_lab.ground_truth import group_drift
    from snip_lab.variants import module_type

    groups: dict[str, list[str]] = {}
    for name in per_batch[0]:
        groups.setdefault(module_type(name), []).append(name)
    config = trainer.config
    common = dict(seq_length=config.model.seq_length, micro_batch_size=config.training.micro_batch_size, seed=seed,
                  metric=config.snip.snip_update_metric)
    out = {}
    for fmt in formats:
        bwd = group_drift(trainer.model, trainer.optimizer, trainer.precision, batches, groups,
                          Precision("bf16", fmt), **common)
        fwd = group_drift(trainer.model, trainer.optimizer, trainer.precision, batches, groups,
                          Precision(fmt, "bf16"), **common)
        # the input gradient's error from the quantized weight alone: the part that repeats (results/notebook.md)
        dgrad_w = group_drift(trainer.model, trainer.optimizer, trainer.precision, batches, groups,
                              Precision("bf16", fmt), operands={("dgrad", "w")}, **common)
        def estimate(part: str, names: list[str], fmt: str = fmt) -> float:
            return sum(sum(getattr(est[n][fmt], part) for n in names if fmt in est[n]) / stats.update_sq
                       for stats, est in zip(cycles, per_batch)) / len(cycles)

        out[fmt] = {t: {
            "SNIP local": estimate("update_local", names),
            "bwd: own": bwd[t].own,
            "SNIP propagated": estimate("update_propagated", names),
            "bwd: other": bwd[t].other,
            "bwd: persistence": bwd[t].persistence,
            "bwd: own persistence": bwd[t].own_persistence,
            "bwd: other persistence": bwd[t].other_persistence,
            "dgrad W only: other": dgrad_w[t].other,
            "dgrad W only: other persistence": dgrad_w[t].other_persistence,
            "fwd: own + other": fwd[t].own + fwd[t].other,
            "fwd: persistence": fwd[t].persistence} for t, names in groups.items()}
    return out


def main() -> int:
    from megatron_snip.compat.cpu import silence_expected_warnings

    silence_expected_warnings()
    import torch.distributed as dist

    from megatron_snip.arguments import ArgumentError
    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.numerics.registry import precision_format
    from megatron_snip.snip.estimators import divergences, local_error_baselines
    from megatron_snip.snip.probes import ProbeConfig, gather_across_pipeline, run_probe_cycle
    from snip_lab.ground_truth import backward_ground_truth, forward_ground_truth
    from snip_lab.ranks import rank_correlations

    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--validate-batches", type=int, default=2, help="global batches of the ground truth")
    own.add_argument("--validate-seeds", type=int, default=2, help="rounding seeds of the ground truth")
    own.add_argument("--output", default=None, help="write the correlations and all values as JSON")
    own.add_argument("--validate-by-type", action="store_true",
                     help="instead of every module alone, every module type at once: the exact update drift "
                          "of its backward (own weights / other weights, next to SNIP's local / propagated "
                          "parts) and of its forward GEMMs, and the cosine of the drift between batches "
                          "(persistence; whole, own weights, the rest), and the drift of dgrad's quantized "
                          "weight alone; needs --validate-batches 2 or more")
    opts, rest = own.parse_known_args()
    if opts.validate_by_type and opts.validate_batches < 2:
        print(f"snip_validate.py: error: --validate-by-type compares the update drift of different batches: "
              f"give --validate-batches 2 or more (got {opts.validate_batches})", file=sys.stderr)
        return 2
    try:
        trainer = trainer_from_command_line(rest)
    except ArgumentError as e:
        print(f"snip_validate.py: error: {e}", file=sys.stderr)
        return 2
    config = trainer.config
    if config.checkpoint.load:
        trainer.resume()
    if trainer.state.iteration < config.training.train_iters:  # a fresh model: train it first
        trainer.train()
    formats = [f for f in config.snip.snip_formats if precision_format(f).quantized]
    n_mb = config.training.num_microbatches
    seq_length, micro_batch_size = config.model.seq_length, config.training.micro_batch_size
    data = trainer.batches("train", trainer.state.consumed_samples)
    batches = [list(islice(data, n_mb)) for _ in range(opts.validate_batches)]

    # One probe cycle per batch the ground truth is measured on: estimates and truth on the same batches.
    cycles = [gather_across_pipeline(run_probe_cycle(
        trainer.model, trainer.optimizer, trainer.precision, iter(batch), num_microbatches=n_mb,
        seq_length=seq_length, micro_batch_size=micro_batch_size,
        config=ProbeConfig.from_snip(config.snip, config.training.seed),
        iteration=trainer.state.iteration)) for batch in batches]
    per_batch = [divergences(stats) for stats in cycles]
    if opts.validate_by_type:
        table_by_type = by_type(trainer, cycles, per_batch, batches, formats, seed=0)
        if dist.get_rank() == 0:
            for fmt, rows in table_by_type.items():
                print(f"\nSNIP's update terms and the exact update drift in {fmt}, every module of a type at once, "
                      f"at iteration {trainer.state.iteration} (each / ||u||^2, in the "
                      f"{config.snip.snip_update_metric} update metric; mean over {opts.validate_batches} "
                      f"batches; persistence: mean cosine between the batches' drifts)\n")
                print(type_table(rows))
            if opts.output:
                Path(opts.output).write_text(json.dumps(
                    {"iteration": trainer.state.iteration, "by_type": table_by_type}, indent=1))
                print(f"\nwrote {opts.output}")
        dist.destroy_process_group()
        return 0
    est_fwd = mean_tables([{m: {f: d.forward for f, d in per.items()} for m, per in est.items()} for est in per_batch])
    est_bwd = mean_tables([{m: {f: d.backward for f, d in per.items()} for m, per in est.items()}
                           for est in per_batch])
    baselines = [local_error_baselines(stats) for stats in cycles]
    absolute, relative = (mean_tables([b[i] for b in baselines]) for i in (0, 1))
    seeds = tuple(range(opts.validate_seeds))
    common = dict(seq_length=seq_length, micro_batch_size=micro_batch_size, seeds=seeds)
    fwd = forward_ground_truth(trainer.model, trainer.precision, batches, formats, **common)
    bwd = backward_ground_truth(trainer.model, trainer.optimizer, trainer.precision, batches, formats, **common,
                                metric=config.snip.snip_update_metric)

    rows = {
        "forward: SNIP dL/loss vs loss change": rank_correlations(est_fwd, fwd.loss_change),
        "forward: |E|^2 baseline vs loss change": rank_correlations(absolute, fwd.loss_change),
        "forward: |E|^2/|Y|^2 baseline vs loss change": rank_correlations(relative, fwd.loss_change),
        "forward: SNIP vs change minus its linear term": rank_correlations(est_fwd, fwd.second_order),
        "forward: |E|^2 vs change minus linear term": rank_correlations(absolute, fwd.second_order),
        "forward: |E|^2/|Y|^2 vs change minus lin. term": rank_correlations(relative, fwd.second_order),
        "backward: SNIP dU/|u|^2 vs update drift": rank_correlations(est_bwd, bwd),
        "backward: |E|^2 baseline vs update drift": rank_correlations(absolute, bwd),
        "backward: |E|^2/|Y|^2 baseline vs update drift": rank_correlations(relative, bwd),
    }
    if dist.get_rank() == 0:
        print(f"\nSNIP estimators vs ground truth at iteration {trainer.state.iteration}: {len(est_bwd)} modules x "
              f"{len(formats)} formats, ground truth over {opts.validate_batches} batches x {len(seeds)} seeds "
              f"(Spearman rank correlation)\n")
        print(table(rows, formats))
        if opts.output:
            Path(opts.output).write_text(json.dumps({
                "iteration": trainer.state.iteration, "correlations": rows, "estimate_forward": est_fwd,
                "estimate_backward": est_bwd, "truth_forward": fwd.loss_change,
                "truth_forward_second_order": fwd.second_order, "truth_backward": bwd,
                "baseline_absolute": absolute, "baseline_relative": relative}, indent=1))
            print(f"\nwrote {opts.output}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
