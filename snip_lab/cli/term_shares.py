"""Where SNIP's terms put a format's cost: each layer's and each module type's share of the loss term
(``dL/loss``) and of the update term, as one probe cycle measures them on a run's state.

    torchrun --nproc-per-node 1 tools/lab/term_shares.py $FLAGS --load runs/qs8/seed1/trunk/ckpt \\
        --train-iters 100 --snip --snip-interval 1000 --snip-curvature hutchinson --snip-probe-passes 16 \\
        --format mxfp4

``$FLAGS`` are the run's pretrain_llama.py flags; the state is ``--load``'s checkpoint (trained on to
``--train-iters`` first if that is further), and the probe batch the global batch after it. The probe
settings are the run's ``--snip-*`` flags (the curvature, the draws). One process (TP = PP = 1). Prints
each term's shares per layer and per type; ``--json`` writes them. What the ablations of a comparison
measured per layer and type is in its report: docs/evidence.md compares the two.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, help="the quantized format whose costs are split (e.g. mxfp4)")
    p.add_argument("--json", help="also write the shares here")
    a, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)

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
    tables = cost_tables(stats, formats=[a.format])
    result = {"iteration": trainer.state.iteration, "format": a.format, "curvature": c.snip.snip_curvature,
              "loss term": shares(tables.forward, a.format), "update term": shares(tables.backward, a.format)}
    print(f"{a.format} at iteration {result['iteration']} ({result['curvature']} curvature): each group's share "
          "of the term")
    for term in ("loss term", "update term"):
        for kind, groups in result[term].items():
            print(f"{term:<12} {kind:<7} " + "  ".join(f"{g} {v:.3f}" for g, v in sorted(groups.items())))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
