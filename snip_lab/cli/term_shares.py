"""Where SNIP's terms put a format's cost: each layer's and each module type's share of the objective the ILP
plans by (the run's ``--snip-loss-weight`` and ``--snip-update-weight``), of its loss term (``dL/loss``) and of
its update term, as one probe cycle measures them on a run's state.

    torchrun --nproc-per-node 1 tools/lab/term_shares.py $FLAGS --load runs/qs8/seed1/trunk/ckpt \\
        --train-iters 100 --snip --snip-interval 1000 --snip-curvature hutchinson --snip-probe-passes 16 \\
        --format mxfp4

``$FLAGS`` are the run's pretrain_llama.py flags; the state is ``--load``'s checkpoint (trained on to
``--train-iters`` first if that is further), and the probe batch the global batch after it. The probe
settings are the run's ``--snip-*`` flags (the curvature, the draws). One process (TP = PP = 1). Prints
each term's shares per layer and per type; ``--json`` writes them. What the ablations of a comparison
measured per layer and type is in its report, or in its ``oracle/costs.json``: ``--ablation-costs FILE``
prints each term's Spearman correlation with them over the layers and over the types.

``--equilibrium-steps T`` adds two exact terms that no probe estimates: each layer's and each type's
backward in the format for real (``snip_lab.ground_truth.equilibrium_costs``, ``--equilibrium-batches``
global batches after the state, two rounding draws), its gradient error priced at what it costs once
training has run T steps with it (the repeated part and the independent part; nats): the one-step update
term's candidate for an error that persists over the re-plan interval (docs/evidence.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from itertools import islice

from megatron_snip.precision.plan import parse_module_name


def shares(table: dict[str, dict[str, float]], fmt: str) -> dict[str, dict[str, float]]:
    """``{"layers": {"layer<i>": share}, "types": {"linear_<type>": share}}`` of a cost table's ``fmt`` column
    (module -> format -> cost), each share its group's cost over the total."""
    total = sum(per[fmt] for per in table.values())
    out: dict[str, dict[str, float]] = {"layers": {}, "types": {}}
    for name, per in table.items():
        for kind, group in (("layers", f"layer{parse_module_name(name)[0]}"), ("types", name.rsplit(".", 1)[-1])):
            out[kind][group] = out[kind].get(group, 0.0) + per[fmt] / total
    return out


EQUILIBRIUM_TERMS = ["equilibrium, repeated", "equilibrium, independent"]


def equilibrium_terms(trainer, fmt: str, steps: int, batches: int) -> dict:
    """The two equilibrium terms' shares (``shares``' layout) and totals, for each layer's and each type's backward in
    ``fmt``, on the ``batches`` global batches after the trainer's state."""
    from snip_lab.ground_truth import equilibrium_costs

    c = trainer.config
    n, gbs = c.training.num_microbatches, c.training.global_batch_size
    data = [list(islice(trainer.batches("train", trainer.state.consumed_samples + k * gbs), n)) for k in range(batches)]
    groups: dict[str, list[str]] = {}
    for name in trainer.precision.modules():
        groups.setdefault(f"layer{parse_module_name(name)[0]}", []).append(name)
        groups.setdefault(name.rsplit(".", 1)[-1], []).append(name)
    costs = equilibrium_costs(trainer.model, trainer.optimizer, trainer.precision, data, groups, fmt,
                              seq_length=c.model.seq_length, micro_batch_size=c.training.micro_batch_size,
                              steps=steps, tokens=gbs * c.model.seq_length)
    out: dict = {"totals": {}}
    for i, term in enumerate(EQUILIBRIUM_TERMS):
        out[term] = {}
        for kind, prefix in (("layers", "layer"), ("types", "linear_")):
            part = {g: v[i] for g, v in costs.items() if g.startswith(prefix)}
            total = sum(part.values())
            out[term][kind] = {g: v / total for g, v in part.items()}
        out["totals"][term] = sum(v[i] for g, v in costs.items() if g.startswith("layer"))
    return out


def against_ablations(terms: dict[str, dict[str, dict[str, float]]], ablations: dict[str, float]
                      ) -> dict[str, dict[str, float]]:
    """term -> {"layers": rho, "types": rho}: Spearman's correlation of the term's group shares with the ablations'
    costs (``ablate-<group>``) over the groups both hold."""
    from snip_lab.ranks import spearman

    out = {}
    for term, kinds in terms.items():
        out[term] = {}
        for kind, groups in kinds.items():
            held = [g for g in sorted(groups) if f"ablate-{g}" in ablations]
            out[term][kind] = spearman([groups[g] for g in held], [ablations[f"ablate-{g}"] for g in held])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, help="the quantized format whose costs are split (e.g. mxfp4)")
    p.add_argument("--json", help="also write the shares here")
    p.add_argument("--ablation-costs", help="a comparison's oracle/costs.json (ablate-layer<i>, ablate-linear_<type>): "
                   "print each term's Spearman correlation with the ablations, over the layers and over the types")
    p.add_argument("--equilibrium-steps", type=int, default=0,
                   help="also the exact equilibrium terms, priced over this many steps (0: not)")
    p.add_argument("--equilibrium-batches", type=int, default=2, help="global batches the equilibrium terms average")
    a, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if a.ablation_costs and not os.path.isfile(a.ablation_costs):
        print(f"term_shares.py: error: --ablation-costs {a.ablation_costs}: no such file; give a comparison's "
              "oracle/costs.json", file=sys.stderr)
        return 2

    from megatron_snip.cli.pretrain import trainer_from_command_line
    from megatron_snip.compat.cpu import silence_expected_warnings
    from megatron_snip.snip.estimators import cost_tables
    from megatron_snip.snip.probes import ProbeConfig, run_probe_cycle

    silence_expected_warnings()
    trainer = trainer_from_command_line(rest)
    c = trainer.config
    if c.snip is None or a.format not in c.snip.snip_formats:
        print(f"term_shares.py: error: --format {a.format}: give --snip and a --snip-formats that holds it "
              f"(the run's: {None if c.snip is None else ' '.join(c.snip.snip_formats)})", file=sys.stderr)
        return 2
    if c.checkpoint.load_dir:
        trainer.resume()
    trainer.train()
    n = c.training.num_microbatches
    batch = list(islice(trainer.batches("train", trainer.state.consumed_samples), n))
    stats = run_probe_cycle(trainer.model, trainer.optimizer, trainer.precision, iter(batch), num_microbatches=n,
                            seq_length=c.model.seq_length, micro_batch_size=c.training.micro_batch_size,
                            config=ProbeConfig.from_snip(c.snip, c.training.seed), iteration=trainer.state.iteration)
    tables = cost_tables(stats, c.snip.snip_loss_weight, c.snip.snip_update_weight, formats=[a.format])
    result = {"iteration": trainer.state.iteration, "format": a.format, "curvature": c.snip.snip_curvature,
              "objective": shares(tables.joint, a.format), "loss term": shares(tables.forward, a.format),
              "update term": shares(tables.backward, a.format)}
    terms = ["objective", "loss term", "update term"]
    if a.equilibrium_steps:
        result.update(equilibrium_terms(trainer, a.format, a.equilibrium_steps, a.equilibrium_batches))
        terms += EQUILIBRIUM_TERMS
    print(f"{a.format} at iteration {result['iteration']} ({result['curvature']} curvature): each group's share "
          "of the term")
    for term in terms:
        for kind, groups in result[term].items():
            print(f"{term:<12} {kind:<7} " + "  ".join(f"{g} {v:.3f}" for g, v in sorted(groups.items())))
    if a.equilibrium_steps:
        totals = result["totals"]
        print("equilibrium terms' totals (nats): " + ", ".join(f"{t} {totals[t]:.3e}" for t in EQUILIBRIUM_TERMS))
    if a.ablation_costs:
        with open(a.ablation_costs) as f:
            result["spearman"] = against_ablations({t: result[t] for t in terms}, json.load(f)["groups"])
        for term, rho in result["spearman"].items():
            print(f"{term:<12} Spearman with the ablations: layers {rho['layers']:+.2f}, types {rho['types']:+.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
