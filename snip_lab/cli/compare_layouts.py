"""Two SNIP runs that differ only in their parallel layout: their cycles' costs and plans side by side.

    python tools/lab/compare_layouts.py runs/cp1/snip runs/cp2/snip

Prints, per cycle both runs wrote (``SAVE/snip/snip_iter_N.json``), the largest ratio between the two
runs' update costs and loss costs over every (module, format), which pair it is, and whether the plans
agree (snip_lab/layouts.py); with ``--parts``, also where the update costs part: the largest ratios of
their local parts (exact on the batch) and propagated parts (the sketch), and the median correlation of
the two runs' draws. Exit status 1 if ``--max-update-ratio`` is given and exceeded, or the plans
differ.
"""

from __future__ import annotations

import argparse
import sys

from snip_lab.layouts import compare_runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", help="the snip/ folder of one run (SAVE/snip)")
    p.add_argument("run_b", help="the snip/ folder of the other")
    p.add_argument("--max-update-ratio", type=float, default=None,
                   help="fail (exit 1) where the update costs of a (module, format) differ by more than this factor")
    p.add_argument("--parts", action="store_true",
                   help="also the update costs' local and propagated parts and how alike the two runs' draws are")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
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


if __name__ == "__main__":
    sys.exit(main())
