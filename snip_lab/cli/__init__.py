"""The lab's entry points, one module per tool: a ``main(argv)`` behind a ``snip-lab-*`` console script
(pyproject.toml) and a ``tools/lab/NAME.py`` launcher."""
