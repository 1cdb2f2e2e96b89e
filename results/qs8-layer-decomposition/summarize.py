"""The tables of README.md, from run.sh's files in OUT.

    python results/qs8-layer-decomposition/summarize.py OUT FIRST_ABLATIONS

FIRST_ABLATIONS: the first machine's seed-2 layer gaps ({"groups": {"ablate-layer0": gap, ...}}).
"""

import json
import sys
from pathlib import Path

from snip_lab.ranks import spearman

LAYERS = range(8)


def main(out: str, first: str) -> None:
    out = Path(out)
    rows = {r["arm"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    bf16 = rows["bf16"]["valid_loss"]
    gap = [rows[f"ablate-layer{i}"]["gap"] for i in LAYERS]
    earlier = [json.loads(Path(first).read_text())["groups"][f"ablate-layer{i}"] for i in LAYERS]
    evals = {}
    for line in (out / "evals.txt").read_text().splitlines():
        layer, what, value = line.split()
        evals[(int(layer.removeprefix("layer")), what)] = float(value)
    # the ablation's final state in BF16, and the BF16 branch's final state with only that layer in MXFP4
    state = [evals[(i, "state_in_bf16")] - bf16 for i in LAYERS]
    forward = [evals[(i, "bf16_state_in_plan")] - bf16 for i in LAYERS]
    shares = {it: json.loads((out / f"shares_{it}.json").read_text()) for it in (100, 300)}
    loss_term = {it: [s["loss term"]["layers"][f"layer{i}"] for i in LAYERS] for it, s in shares.items()}
    truth = json.loads((out / "validate_300.json").read_text())

    def per_layer(table: dict) -> list[float]:  # module -> format -> relative loss change, summed per layer, in nats
        sums = [0.0] * len(LAYERS)
        for name, row in table.items():
            sums[int(name.split(".")[2])] += row["mxfp4"] * bf16
        return sums

    exact, second = per_layer(truth["truth_forward"]), per_layer(truth["truth_forward_second_order"])

    def share(xs: list[float]) -> list[float]:
        pos = [max(x, 0.0) for x in xs]
        return [x / sum(pos) for x in pos]

    print("| layer | gap to BF16 | first machine | state in BF16 | forward on BF16's end | "
          "exact, probe batches | its 2nd order | loss term at 100 | at 300 |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    fs, es, ss = share(forward), share(exact), share(second)
    for i in LAYERS:
        print(f"| {i} | {gap[i]:+.4f} | {earlier[i]:+.4f} | {state[i]:+.4f} | {forward[i]:+.4f} ({fs[i]:.0%}) | "
              f"{exact[i]:+.4f} ({es[i]:.0%}) | {second[i]:+.4f} ({ss[i]:.0%}) | {loss_term[100][i]:.0%} | "
              f"{loss_term[300][i]:.0%} |")
    print(f"| sum | {sum(gap):+.4f} | {sum(earlier):+.4f} | {sum(state):+.4f} | {sum(forward):+.4f} | "
          f"{sum(exact):+.4f} | {sum(second):+.4f} | | |")
    print("\nSpearman over the 8 layers, against the gaps to BF16 (this machine / the first one):")
    for name, xs in (("the first machine's gaps", earlier), ("state in BF16", state),
                     ("forward on BF16's end (validation batches)", forward), ("exact, probe batches", exact),
                     ("its 2nd order", second), ("loss term at 100", loss_term[100]),
                     ("loss term at 300", loss_term[300])):
        print(f"- {name}: {spearman(xs, gap):+.2f} / {spearman(xs, earlier):+.2f}; "
              f"against the forward cost on BF16's end {spearman(xs, forward):+.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
