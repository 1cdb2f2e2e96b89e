"""The program's entry points: ``pretrain.py`` (``pretrain_llama.py``) and one module per tool, each a
``main(argv)`` behind a console script (pyproject.toml) and a ``tools/NAME.py`` launcher."""
