"""Low-precision numerics, usable without megatron-core: element formats, block scaling, the
quantizers (FP8 tensorwise and block, MXFP8/MXFP4, NVFP4), the random Hadamard transform, fake
quantization, the Triton kernels, per-operand recipes and the quantized linear GEMM (an autograd
function on plain tensors). ``registry`` is the one vocabulary of precision names.

See docs/numerics.md for the formats and the choices made where they leave freedom. The names below
are imported on first use (PEP 562), so naming a format (``registry``) needs no torch.
"""

from megatron_snip.compat.lazy import lazy_getattr

# name -> the submodule that defines it
_EXPORTS = {
    "BlockScaled": "blocks",
    "FORMATS": "fake_quant",
    "ROLES": "fake_quant",
    "element_bits": "fake_quant",
    "fake_quantize": "fake_quant",
    "E2M1": "formats",
    "E4M3": "formats",
    "E5M2": "formats",
    "FloatFormat": "formats",
    "decode_e2m1": "formats",
    "decode_e4m3": "formats",
    "decode_e5m2": "formats",
    "decode_e8m0": "formats",
    "encode_e2m1": "formats",
    "encode_e4m3": "formats",
    "encode_e5m2": "formats",
    "encode_e8m0": "formats",
    "round_e2m1_stochastic": "formats",
    "round_to_format": "formats",
    "to_elements": "formats",
    "FP8DelayedScaling": "fp8",
    "TensorScaled": "fp8",
    "fp8_scale_from_amax": "fp8",
    "quantize_fp8_block": "fp8",
    "quantize_fp8_tensorwise": "fp8",
    "hadamard_matrix": "hadamard",
    "inverse_random_hadamard_transform": "hadamard",
    "random_hadamard_transform": "hadamard",
    "random_signs": "hadamard",
    "QuantState": "linear",
    "hadamard_wgrad_operands": "linear",
    "quantize_operand": "linear",
    "quantized_linear": "linear",
    "quantize_mx": "mx",
    "quantize_mxfp4": "mx",
    "quantize_mxfp8": "mx",
    "NVFP4Quantized": "nvfp4",
    "nvfp4_global_scale": "nvfp4",
    "quantize_nvfp4": "nvfp4",
    "BF16": "recipes",
    "OperandQuantizer": "recipes",
    "PRECISION_NAMES": "recipes",
    "Precision": "recipes",
    "RecipeConfig": "recipes",
    "operand_quantizer": "recipes",
    "is_fp4": "registry",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
