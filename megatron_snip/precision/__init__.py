"""Low-precision numerics: element formats, quantizers, Hadamard transform, fake quantization.

See docs/numerics.md for the formats and the choices made where they leave freedom.
"""

from .blocks import BlockScaled
from .fake_quant import FORMATS, ROLES, element_bits, fake_quantize, is_fp4, is_fp8
from .formats import (
    E2M1,
    E4M3,
    E5M2,
    FloatFormat,
    decode_e2m1,
    decode_e4m3,
    decode_e5m2,
    decode_e8m0,
    encode_e2m1,
    encode_e4m3,
    encode_e5m2,
    encode_e8m0,
    round_e2m1_stochastic,
    round_to_format,
)
from .fp8 import (
    FP8DelayedScaling,
    TensorScaled,
    fp8_scale_from_amax,
    quantize_fp8_block,
    quantize_fp8_tensorwise,
)
from .hadamard import (
    hadamard_matrix,
    inverse_random_hadamard_transform,
    random_hadamard_transform,
    random_signs,
)
from .mx import quantize_mx, quantize_mxfp4, quantize_mxfp8
from .nvfp4 import NVFP4Quantized, nvfp4_global_scale, quantize_nvfp4

__all__ = [
    "BlockScaled",
    "E2M1",
    "E4M3",
    "E5M2",
    "FORMATS",
    "FP8DelayedScaling",
    "FloatFormat",
    "NVFP4Quantized",
    "ROLES",
    "TensorScaled",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e5m2",
    "decode_e8m0",
    "element_bits",
    "encode_e2m1",
    "encode_e4m3",
    "encode_e5m2",
    "encode_e8m0",
    "fake_quantize",
    "fp8_scale_from_amax",
    "hadamard_matrix",
    "inverse_random_hadamard_transform",
    "is_fp4",
    "is_fp8",
    "nvfp4_global_scale",
    "quantize_fp8_block",
    "quantize_fp8_tensorwise",
    "quantize_mx",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "random_hadamard_transform",
    "random_signs",
    "round_e2m1_stochastic",
    "round_to_format",
]

# Per-module precision: recipes, the quantized linear GEMMs, plans, FLOP accounting.
from .flops import FlopFractions, LlamaLinearDims, flop_fractions, flops_by_format, gemm_flops
from .linear import QuantState, hadamard_wgrad_operands, quantize_operand, quantized_linear
from .plan import LINEAR_MODULES, PlanError, PrecisionPlan, module_name, module_names, parse_module_name
from .recipes import BF16, PRECISION_NAMES, OperandQuantizer, Precision, RecipeConfig, operand_quantizer

__all__ += [
    "BF16",
    "FlopFractions",
    "LINEAR_MODULES",
    "LlamaLinearDims",
    "OperandQuantizer",
    "PRECISION_NAMES",
    "PlanError",
    "Precision",
    "PrecisionPlan",
    "QuantState",
    "RecipeConfig",
    "flop_fractions",
    "flops_by_format",
    "gemm_flops",
    "hadamard_wgrad_operands",
    "module_name",
    "module_names",
    "operand_quantizer",
    "parse_module_name",
    "quantize_operand",
    "quantized_linear",
]
