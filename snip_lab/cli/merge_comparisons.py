"""Merge comparisons' reports into one table: seeds or arms trained in separate folders.

    python tools/lab/merge_comparisons.py --out runs/merged runs/compare_s123 runs/compare_s45
    python tools/lab/merge_comparisons.py --out runs/merged results/STUDY/compare_a.json results/STUDY/compare_b.json \\
        runs/oracle3/results.json --oracle-from runs/oracle3/results.json

Each source is a ``tools/lab/compare_precision.py`` report (``OUT/results.json``, or the folder OUT).
The merge summarizes every (branch, seed) the reports hold as one comparison over all their seeds
would: gaps to the BF16 branch of the same seed, regrets to the oracle's, each arm against SNIP's
(or --versus POLICY's) with 95% intervals. It refuses reports of other settings (model, data,
iterations, window, formats), a branch whose numbers differ between two reports (other trunks), and
oracles planned with different costs unless --oracle-from names the report whose oracle rows to keep
(snip_lab/merge.py). Writes OUT/results.md and OUT/results.json (no plot: reports keep
no curves) and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from snip_lab.merge import merge_reports, write_merged


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+",
                   help="results.json files of tools/lab/compare_precision.py, or their --out folders")
    p.add_argument("--out", required=True, help="folder for the merged results.md and results.json")
    p.add_argument("--oracle-from", default=None, metavar="REPORT",
                   help="the report (one of those merged) whose oracle rows to keep, where the reports' oracles "
                        "planned with different costs")
    p.add_argument("--versus", default=None, metavar="POLICY",
                   help="set every arm against this one in the paired table (default: snip, else snip-fixed, else "
                        "snip-loss-term)")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    try:
        summary = merge_reports(a.reports, str(out), oracle_from=a.oracle_from, versus=a.versus,
                                log=lambda m: print(f"merge_comparisons.py: note: {m}", file=sys.stderr))
        write_merged(summary, out)
    except ValueError as e:
        print(f"merge_comparisons.py: error: {e}", file=sys.stderr)
        return 1
    print((out / "results.md").read_text())
    print(f"report: {out}/results.md, results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
