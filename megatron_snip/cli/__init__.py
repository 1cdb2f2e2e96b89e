"""The program's entry points: ``pretrain.py`` (``pretrain_llama.py``) and one module per tool, each a
``main(argv)`` behind a console script (pyproject.toml) and a ``tools/NAME.py`` launcher."""

from dataclasses import fields


def config_from_args(cls, args):
    """A tool's config dataclass ``cls`` from its parsed flags, field by field (a flag is named as its field;
    ``nargs`` lists become the tuples the frozen configs hold). Fields without a flag keep their defaults."""
    given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    return cls(**{name: tuple(v) if isinstance(v, list) else v for name, v in given.items()})
