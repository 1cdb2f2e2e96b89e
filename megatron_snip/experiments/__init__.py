"""Experiments that train several runs and compare them (``tools/compare_precision.py``)."""
