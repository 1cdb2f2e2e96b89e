"""Head-to-head of precision policies: one training branch per (policy, budget, seed).

    python tools/lab/compare_precision.py --out runs/compare --seeds 1 2 3 --trunk-iters 100 \\
        --train-iters 300 --snip-interval 100 --fp4-targets 0.5 0.75 0.9 \\
        --policies snip snip-fixed uniform nvidia-recipe random min-relative-error threshold \\
        -- --model-preset tiny --micro-batch-size 8 --global-batch-size 16 --lr 3e-3 ... \\
           --data-path DATA --tokenizer-model TOK --eval-interval 50 --eval-iters 8

For each seed a trunk trains in BF16 to --trunk-iters and runs one SNIP cycle; from that
checkpoint every arm trains to --train-iters on the same batches: the BF16 reference, SNIP
re-planning every --snip-interval ("snip"; "snip-loss-term-replanned" with --snip-update-weight 0;
"snip-fisher-loss-term-replanned" adding --snip-curvature fisher), SNIP's first plan fixed
("snip-fixed"), and the baselines, each at
exactly the same budget (plans from the trunk's statistics, megatron_snip/snip/policies.py).
Flags after "--" go to every pretrain_llama.py run (model, data, optimizer, layout: add
--tensor-model-parallel-size etc. with --nproc-per-node). Of SNIP's flags only the probe settings
--snip-gain-exclude and --snip-probe-passes may be among them: they change what SNIP measures (the
trunk's cycle, hence every first plan from its statistics, and every re-plan), not how an arm trains.

--ablations layers types adds the per-module ground truth: one arm per layer / module type
with only that group in FP4, and the rank correlation of SNIP's predicted divergence (and of
the relative quantization error) with the loss gap training measured; --ablations modules, one
arm per module.

--policies ... oracle (with --ablations layers types, or modules) adds the oracle: the same ILP
with the costs the ablation arms measured, trained after them at every budget, and each policy's
regret to it (snip_lab/oracle.py; it adds the all-high arm ablate-none). The costs
are kept in OUT/oracle/costs.json; --oracle-costs FILE plans the oracle with such a file of an
earlier comparison of the same model instead of ablations (more seeds in another folder). With the
oracle the report ends with its test of SNIP's plans: SNIP's gap to BF16 within 1.25x the oracle's,
and every arm the oracle leads by 2 paired standard deviations led by SNIP by 2 too.

--noise-floor adds the noise floor: BF16 again from each trunk on another order of the training
documents (the validation documents and samples unchanged; snip_lab/reorder.py),
whose paired gap to BF16 is what arms differ by when nothing but the batches differs. The report
sets every arm at a budget against SNIP's with the paired difference's 95% interval.

--jobs N trains N runs at once (on a 2-core CPU, --jobs 2: every run is single-threaded; on a GPU
node, each run gets its own --nproc-per-node GPUs); the results do not depend on it. Arms of one
seed that start from the same fixed plan (uniform at every budget) train once and share the result.

Writes OUT/results.md, OUT/results.json, OUT/gap_to_bf16.png and TensorBoard runs side by
side under OUT/tensorboard. Rerunning the same command finishes what an interrupted one left;
with --report-only it writes the report of what has finished so far and trains nothing.
SIGTERM or SIGUSR1 (kill, SLURM's --signal) stops it cleanly: the runs in flight save a checkpoint,
no new one starts, and the tool exits with 128 + the signal's number. Seeds or arms run as separate
jobs in separate --out folders make one table with tools/lab/merge_comparisons.py.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from snip_lab.ablation import KINDS
from snip_lab.branches import ARMS, ComparisonConfig, parse_budgets
from snip_lab.comparison import Comparison, Stopped
from snip_lab.oracle import ORACLE


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (reused to resume)")
    p.add_argument("--policies", nargs="*", choices=ARMS, default=[a for a in ARMS if a != ORACLE],
                   help=f"arms besides the BF16 reference (default: all but {ORACLE}, which needs --ablations "
                        "layers types, or modules, or --oracle-costs)")
    p.add_argument("--fp4-targets", type=float, nargs="*", default=None,
                   help="FP4 budgets (share of linear FLOPs; default 0.75 when no --time-targets)")
    p.add_argument("--time-targets", type=float, nargs="*", default=[],
                   help="time budgets (estimated linear-GEMM time / all-bf16)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5],
                   help="one trunk and one branch per arm each (default: 5; with 3, most paired differences between "
                        "good plans stayed within noise)")
    p.add_argument("--trunk-iters", type=int, required=True, help="BF16 iterations before the branch point")
    p.add_argument("--train-iters", type=int, required=True, help="total iterations of every branch")
    p.add_argument("--snip-interval", type=int, default=None,
                   help="re-planning (and checkpoint) interval of the snip arm (default: --trunk-iters)")
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "nvfp4"], help="SNIP candidates")
    p.add_argument("--nproc-per-node", type=int, default=1, help="processes per run")
    p.add_argument("--jobs", type=int, default=1,
                   help="runs training at once (on CPU: up to the cores, each run is single-threaded; on GPUs: "
                        "each run gets its own --nproc-per-node devices); results do not depend on it")
    p.add_argument("--window", type=int, default=0,
                   help="mean training loss over the last N iterations (default: a fifth of the branch)")
    p.add_argument("--solver", choices=["auto", "gurobi", "highs"], default="auto")
    p.add_argument("--ablations", nargs="+", choices=KINDS, default=[],
                   help="also train one arm per layer ('layers') / module type ('types') / module ('modules') "
                        "with only that group in FP4 (no budget), and rank-correlate the estimators' predictions "
                        "with the gaps")
    p.add_argument("--noise-floor", action="store_true",
                   help="also train BF16 on another order of the training documents from each trunk (the noise floor)")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=[],
                   help="train the ablation arms on these of the --seeds only (default: all); the oracle's costs "
                        "come from them, its branch trains on every seed")
    p.add_argument("--oracle-costs", default=None, metavar="COSTS_JSON",
                   help=f"plan the {ORACLE} arm with an earlier comparison's OUT/{ORACLE}/costs.json (the same model "
                        "and data) instead of --ablations")
    p.add_argument("--versus", default=None, metavar="POLICY",
                   help="set every arm against this one of --policies in the report's paired table (default: "
                        "snip, else snip-fixed, else snip-loss-term)")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the report of the branches finished so far (a comparison still "
                        "running, or cut short; the same settings; rerun without it to finish the rest)")
    a = p.parse_args(argv)
    fp4_targets = a.fp4_targets if a.fp4_targets is not None else ([] if a.time_targets or a.ablations else [0.75])
    try:
        config = ComparisonConfig(
            out=a.out, train_args=tuple(train_args), policies=tuple(a.policies),
            budgets=parse_budgets(fp4_targets, a.time_targets), seeds=tuple(a.seeds), trunk_iters=a.trunk_iters,
            train_iters=a.train_iters, snip_interval=a.snip_interval or a.trunk_iters, formats=tuple(a.formats),
            nproc=a.nproc_per_node, window=a.window, solver=a.solver, ablations=tuple(a.ablations),
            jobs=a.jobs, noise_floor=a.noise_floor, ablation_seeds=tuple(a.ablation_seeds), versus=a.versus,
            oracle_costs=a.oracle_costs)
        comparison = Comparison(config, log=lambda m: print(m, flush=True))
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # kill, SLURM's --signal: the runs save and stop
            signal.signal(sig, comparison.stop)
        if a.report_only:
            comparison.check_settings()
            comparison.report()
        else:
            comparison.run()
    except Stopped as e:
        print(f"compare_precision.py: {e}", file=sys.stderr)
        return 128 + e.signum
    except (ValueError, RuntimeError) as e:
        print(f"compare_precision.py: error: {e}", file=sys.stderr)
        return 1
    print((Path(a.out) / "results.md").read_text())
    print(f"report: {a.out}/results.md, results.json, gap_to_bf16.png; tensorboard --logdir {a.out}/tensorboard")
    return 0


if __name__ == "__main__":
    sys.exit(main())
