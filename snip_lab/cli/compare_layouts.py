"""Two SNIP runs that differ only in their parallel layout: their cycles' costs and plans side by side.

    python tools/lab/compare_layouts.py runs/cp1/snip runs/cp2/snip
    python tools/lab/compare_layouts.py --validated cp1.json cp2.json

Prints, per cycle both runs wrote (``SAVE/snip/snip_iter_N.json``), the largest ratio between the two
runs' update costs and loss costs over every (module, format), which pair it is, and whether the plans
agree (snip_lab/layouts.py); with ``--parts``, also where the update costs part: the largest ratios of
their local parts (exact on the batch) and propagated parts (the sketch), and the median correlation of
the two runs' draws. Exit status 1 if ``--max-update-ratio`` is given and exceeded, or the plans
differ. With ``--validated``, the two arguments are ``tools/lab/snip_validate.py --output`` files of the
runs' checkpoints (the same batches): how far apart the exact update drifts are, next to SNIP's estimates.
"""

from __future__ import annotations

import argparse
import sys

from snip_lab.layouts import compare_runs, compare_validations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", help="the snip/ folder of one run (SAVE/snip)")
    p.add_argument("run_b", help="the snip/ folder of the other")
    p.add_argument("--max-update-ratio", type=float, default=None,
                   help="fail (exit 1) where the update costs of a (module, format) differ by more than this factor")
    p.add_argument("--parts", action="store_true",
                   help="also the update costs' local and propagated parts and how alike the two runs' draws are")
    p.add_argument("--validated", action="store_true",
                   help="run_a and run_b are snip_validate.py --output files of the two runs' checkpoints: compare "
                        "their exact update drifts and SNIP's estimates (pairs apart by more than 1.3x counted)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.validated:
        return _print_validations(a.run_a, a.run_b)
    try:
        cycles = compare_runs(a.run_a, a.run_b)
    except ValueError as e:
        print(f"compare_layouts.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{'iteration':>9}  {'update cost ratio (pair)':<62} {'loss cost ratio (pair)':<62} same plan")
    failed = False
    for c in cycles:
        print(f"{c.iteration:>9}  {c.update_ratio[0]:8.3f} {c.update_ratio[1]:<53} "
              f"{c.loss_ratio[0]:8.3f} {c.loss_ratio[1]:<53} {c.same_plan}")
        failed |= not c.same_plan or (a.max_update_ratio is not None and c.update_ratio[0] > a.max_update_ratio)
    if a.parts:
        print(f"\n{'iteration':>9}  {'local part ratio (pair)':<62} {'propagated part ratio (pair)':<62} "
              "draws' correlation (median)")
        for c in cycles:
            print(f"{c.iteration:>9}  {c.local_ratio[0]:8.3f} {c.local_ratio[1]:<53} "
                  f"{c.propagated_ratio[0]:8.3f} {c.propagated_ratio[1]:<53} {c.draw_correlation:6.2f}")
    return 1 if failed else 0


def _print_validations(path_a: str, path_b: str) -> int:
    try:
        spreads = compare_validations(path_a, path_b)
    except (OSError, ValueError) as e:
        print(f"compare_layouts.py: error: {e}", file=sys.stderr)
        return 2
    print(f"{'drift':<10} {'largest ratio (pair)':<62} {'median':>7}  pairs > 1.3x")
    for name, s in spreads.items():
        print(f"{name:<10} {s.largest[0]:8.3f} {s.largest[1]:<53} {s.median:7.3f}  {s.over} of {s.pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
