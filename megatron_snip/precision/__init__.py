"""Per-module precision as data and cost: plans (which precision each linear module runs) and their
files (JSON, megatron-core's per-module precision YAML), the ``--precision*`` configuration, FLOP
accounting, the GEMM speed model, schedules, and whether a precision runs on a real kernel here. The
numbers themselves are ``megatron_snip.numerics``; the layers that apply a plan to megatron-core's
model are ``megatron_snip.model.quantized``.

The names below are imported on first use (PEP 562).
"""

from megatron_snip.compat.lazy import lazy_getattr

# name -> the submodule that defines it
_EXPORTS = {
    "FlopFractions": "flops",
    "LlamaLinearDims": "flops",
    "flop_fractions": "flops",
    "flops_by_format": "flops",
    "gemm_flops": "flops",
    "LINEAR_MODULES": "plan",
    "PlanError": "plan",
    "PrecisionPlan": "plan",
    "module_name": "plan",
    "module_names": "plan",
    "parse_module_name": "plan",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
