"""The research lab beside the product: policy comparisons, ablations, the oracle, estimator screens and
the estimators' ground truth. It reads megatron_snip's records and plans with its code; megatron_snip never
imports it (tests/test_layering.py). Its studies, with their commands, are in results/."""
