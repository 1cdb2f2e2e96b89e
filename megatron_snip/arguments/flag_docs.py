"""The flag documentation, generated from the configuration sections (the one source of truth):
a compact table in README.md and the full reference in docs/flags.md.

    python -m megatron_snip.arguments.flag_docs --write    # regenerate both
    python -m megatron_snip.arguments.flag_docs            # exit 1 if either is out of date

``tests/test_config_file.py`` keeps them in sync.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_snip.flags import flag_rows
from megatron_snip.training.config import SECTIONS

from .megatron_lm import MegatronLMFlags
from .parser import SCRIPT_FLAGS_TITLE, TITLES

ROOT = Path(__file__).resolve().parents[2]
README, REFERENCE = ROOT / "README.md", ROOT / "docs" / "flags.md"
BEGIN, END = "<!-- flag-table:begin -->", "<!-- flag-table:end -->"


def _sections() -> list[tuple[str, str, type]]:
    """(name, help-group title, section class) in the order of ``--help``."""
    return [(name, TITLES[name], cls) for name, cls in SECTIONS.items()] + \
        [("megatron_lm", SCRIPT_FLAGS_TITLE, MegatronLMFlags)]


def compact_table() -> str:
    """One row per section with its flags' names; this program's own flags in bold."""
    lines = ["| section | flags (**bold**: this program's own; the rest are Megatron-LM's, with its meaning) |",
             "|---|---|"]
    for name, _, cls in _sections():
        names = [option.removeprefix("--") if megatron else f"**{option.removeprefix('--')}**"
                 for option, _, _, megatron in flag_rows(cls)]
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


def readme_with_table(readme: str) -> str:
    """``readme`` with the compact table between its markers; ValueError if they are missing."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md lacks the {BEGIN} / {END} markers of the flag table")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{compact_table()}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate README.md's table and docs/flags.md")
    args = parser.parse_args(argv)
    wanted = {README: readme_with_table(README.read_text()), REFERENCE: reference()}
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
