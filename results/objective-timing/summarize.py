"""The table of README.md: the objective's Spearman correlation with the ablations, per trunk and iteration.

    python results/objective-timing/summarize.py OUT COSTS [COSTS ...]

OUT holds run.sh's s<seed>_<iteration>.json; with several COSTS files the reference is their mean (the
ablations of several seeds; groups all of them hold).
"""

import json
import sys
from pathlib import Path

from snip_lab.ranks import spearman


def main(out: str, *costs: str) -> None:
    refs = [json.loads(Path(c).read_text())["groups"] for c in costs]
    held = [g for g in refs[0] if all(g in r for r in refs)]
    reference = {g: sum(r[g] for r in refs) / len(refs) for g in held}
    print(f"reference: the mean of {len(refs)} ablation file(s) ({', '.join(costs)})")
    for kind, prefix in (("layers", "ablate-layer"), ("types", "ablate-linear_")):
        groups = [g.removeprefix("ablate-") for g in held if g.startswith(prefix)]
        if len(groups) < 3:
            continue
        print(f"{kind}: iteration: trunks 1-5, mean")
        for it in (100, 200, 300):
            rhos = []
            for seed in range(1, 6):
                shares = json.loads((Path(out) / f"s{seed}_{it}.json").read_text())["objective"][kind]
                rhos.append(spearman([shares[g] for g in groups], [reference[f"ablate-{g}"] for g in groups]))
            print(f"  {it}: " + " ".join(f"{r:+.2f}" for r in rhos) + f"  mean {sum(rhos) / len(rhos):+.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
