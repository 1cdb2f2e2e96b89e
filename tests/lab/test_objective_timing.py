"""results/objective-timing: the README's table is what summarize.py makes of the committed shares and ablations."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

STUDY = Path(__file__).resolve().parents[2] / "results" / "objective-timing"
REFERENCES = {"seed 1": ["{c}_seed1.json"], "seed 2": ["{c}_seed2_layers.json"],
              "mean of seeds 1 and 2": ["{c}_seed1.json", "{c}_seed2_layers.json"]}
CORPORA = {"quickstart": "qs8", "prose": "prose8"}


def test_the_readme_table_is_the_summary_of_the_committed_shares(capsys):
    spec = importlib.util.spec_from_file_location("summarize", STUDY / "summarize.py")
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    rows = re.findall(r"^\| (quickstart|prose) \| (seed 1|seed 2|mean of seeds 1 and 2) \| (.+) \|$",
                      (STUDY / "README.md").read_text(), re.M)
    assert len(rows) == 6
    for corpus, reference, cells in rows:
        c = CORPORA[corpus]
        summarize.main(str(STUDY / c), *(str(STUDY / "ablations" / f.format(c=c)) for f in REFERENCES[reference]))
        layers = capsys.readouterr().out.split("layers:")[1].split("types:")[0]
        means = re.findall(r"mean ([+-]\d\.\d\d)", layers)
        assert means == [cell.strip() for cell in cells.split("|")], (corpus, reference)
