"""The flag documentation, generated from the configuration sections (the one source of truth):
a table of this program's own flags in README.md, the full reference in docs/flags.md, and in
docs/megatron_compat.md the answer to each of Megatron-LM's other options and the defaults that differ
(from :mod:`.megatron_lm_families` and :mod:`.megatron_lm`).

    python -m megatron_snip.arguments.flag_docs --write    # regenerate them
    python -m megatron_snip.arguments.flag_docs            # exit 1 if one is out of date

``tests/test_config_file.py`` keeps them in sync.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_snip.flags import flag_rows
from megatron_snip.training.config import SECTIONS

from .megatron_lm import DIFFERENT_DEFAULTS, MegatronLMFlags
from .megatron_lm_families import ACCEPTED, FAMILIES, MEGATRON_LM_OPTIONS, NOTICED, REFUSED, Given
from .parser import SCRIPT_FLAGS_TITLE, TITLES, build_parser

ROOT = Path(__file__).resolve().parents[2]
README, REFERENCE, COMPAT = ROOT / "README.md", ROOT / "docs" / "flags.md", ROOT / "docs" / "megatron_compat.md"
BEGIN, END = "<!-- flag-table:begin -->", "<!-- flag-table:end -->"
ANSWERS = "<!-- megatron-lm-answers:begin -->", "<!-- megatron-lm-answers:end -->"
DEFAULTS = "<!-- megatron-lm-defaults:begin -->", "<!-- megatron-lm-defaults:end -->"


def _sections() -> list[tuple[str, str, type]]:
    """(name, help-group title, section class) in the order of ``--help``."""
    return [(name, TITLES[name], cls) for name, cls in SECTIONS.items()] + \
        [("megatron_lm", SCRIPT_FLAGS_TITLE, MegatronLMFlags)]


def compact_table() -> str:
    """One row per section with this program's own flags (Megatron-LM's are in docs/flags.md)."""
    lines = ["| section | this program's own flags (every flag, Megatron-LM's too: [docs/flags.md](docs/flags.md)) |",
             "|---|---|"]
    for name, _, cls in _sections():
        names = [f"`{option}`" for option, _, _, megatron in flag_rows(cls) if not megatron]
        if names:
            lines.append(f"| {name} | {' '.join(names)} |")
    return "\n".join(lines)


def reference() -> str:
    """docs/flags.md: every flag with its default and help text."""
    out = ["# Flags of pretrain_llama.py", "",
           "Generated from the configuration dataclasses (`python -m megatron_snip.arguments.flag_docs --write`); "
           "`python pretrain_llama.py --help` shows the same. Flags marked *ours* are this program's own; "
           "the others are Megatron-LM's, with Megatron-LM's meaning and default unless the description says why "
           "not. Every flag can also be given in a `--yaml-cfg` file (key: the flag's name), under the command line.",
           ""]
    for _, title, cls in _sections():
        out += [f"## {title}", "", "| flag | default | description |", "|---|---|---|"]
        for option, default, text, megatron in flag_rows(cls):
            text = text.replace("|", "\\|") + ("" if megatron else " *(ours)*")
            out.append(f"| `{option}` | {f'`{default}`' if default else ''} | {text} |")
        out.append("")
    return "\n".join(out)


def _options(dests) -> str:
    return ", ".join(f"`{s}`" for o in MEGATRON_LM_OPTIONS if o.dest in dests for s in o.spellings)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def megatron_lm_answers() -> str:
    """docs/megatron_compat.md's tables of how each of Megatron-LM's options without a flag here is answered."""
    actions = [a for a in build_parser()._actions if a.option_strings and not isinstance(a, Given)]
    ours = {s: a for a in actions for s in a.option_strings}
    implemented = sum(o.spellings[0] in ours for o in MEGATRON_LM_OPTIONS)
    by_family = {f.name: {o.dest for o in MEGATRON_LM_OPTIONS if f.holds(o)} for f in FAMILIES}
    in_families = sum(any(f.holds(o) for f in FAMILIES) for o in MEGATRON_LM_OPTIONS)
    out = [f"Of Megatron-LM 0.16.1's {len(MEGATRON_LM_OPTIONS)} options, {implemented} are flags here "
           f"([flags.md](flags.md)); {len(ACCEPTED)} are accepted, {len(NOTICED)} accepted with a notice, "
           f"{len(REFUSED)} refused by themselves and {in_families} with their family.", "",
           "Accepted without a word (what they ask for is what runs here):", "", "| option | why |", "|---|---|"]
    out += [f"| {_options({dest})} | {_cell(why)} |" for dest, why in ACCEPTED.items()]
    out += ["", "Accepted with a start-up `notice:` line (they change speed, memory or diagnostics only):", "",
            "| option | what runs here |", "|---|---|"]
    out += [f"| {_options({dest})} | {_cell(what)} |" for dest, what in NOTICED.items()]
    out += ["", "Refused by themselves:", "", "| option | why, and what to do |", "|---|---|"]
    out += [f"| {_options({dest})} | {_cell(why)} |" for dest, why in REFUSED.items()]
    out += ["", "Refused with their family:", "", "| family | why | options |", "|---|---|---|"]
    out += [f"| {f.name} | {_cell(f.reason)} | {_options(by_family[f.name])} |" for f in FAMILIES]
    return "\n".join(out)


def megatron_lm_defaults() -> str:
    """docs/megatron_compat.md's table of the flags whose default differs from Megatron-LM's."""
    actions = [a for a in build_parser()._actions if a.option_strings and not isinstance(a, Given)]
    out = ["| flag | Megatron-LM's default | here, and why |", "|---|---|---|"]
    for dest, why in DIFFERENT_DEFAULTS.items():
        option = next(a.option_strings[0] for a in actions if a.dest == dest)
        theirs = next(o.default for o in MEGATRON_LM_OPTIONS if option in o.spellings)
        out.append(f"| `{option}` | {'none' if theirs is None else f'`{theirs}`'} | {_cell(why)} |")
    return "\n".join(out)


def with_section(text: str, markers: tuple[str, str], section: str, name: str) -> str:
    """``text`` with ``section`` between its ``markers``; ValueError if they are missing."""
    begin, end = markers
    if begin not in text or end not in text:
        raise ValueError(f"{name} lacks the {begin} / {end} markers")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{section}\n{end}{tail}"


def readme_with_table(readme: str) -> str:
    """``readme`` with the compact table between its markers; ValueError if they are missing."""
    return with_section(readme, (BEGIN, END), compact_table(), "README.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate README.md's table and docs/flags.md")
    args = parser.parse_args(argv)
    compat = with_section(COMPAT.read_text(), ANSWERS, megatron_lm_answers(), "docs/megatron_compat.md")
    wanted = {README: readme_with_table(README.read_text()), REFERENCE: reference(),
              COMPAT: with_section(compat, DEFAULTS, megatron_lm_defaults(), "docs/megatron_compat.md")}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.write:
        for path in stale:
            path.write_text(wanted[path])
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    for path in stale:
        print(f"{path.relative_to(ROOT)} is out of date: python -m megatron_snip.arguments.flag_docs --write")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
