"""megatron-core's fusions that this program turns on, and the kernels it supplies where apex and
Transformer Engine are absent.

``--no-bias-swiglu-fusion`` and ``--no-bias-dropout-fusion`` switch megatron-core's own fused
code (compiled by ``torch.compile`` through ``megatron.core.jit``); they need nothing else.

``--no-rope-fusion`` switches megatron-core's RoPE fusion, whose kernel is Transformer Engine's.
Without it, :func:`fused_rope` fills megatron-core's slot for that kernel with megatron-core's own
unfused RoPE compiled by ``torch.compile`` (one kernel forward and one backward for each of query
and key, instead of about ten, with cos/sin computed in registers rather than materialised twice).

Without the fusion (a CPU, or ``--no-rope-fusion``), megatron-core's unfused RoPE recomputes the cosines
and sines of the same angles in every layer for the queries and again for the keys, scales them by
1.0, casts them to their own dtype and copies its result through a concatenation with an empty
slice. :func:`enable_lean_rope` gives its slot a version that computes the same values (the same
products and sums, to the bit) with the tables computed once per forward, for the one case the
Llama layers run (half-split rotation over the whole head, no scaling); any other case goes to
megatron-core's function.

``--no-gradient-accumulation-fusion`` switches megatron-core's weight-gradient accumulation: the
bf16 linear layers' backward adds ``dY^T X`` into the parameter's fp32 ``main_grad`` inside the
GEMM, instead of writing a bf16 gradient that megatron-core's DDP hook then adds in a second pass
(a write and a read-modify-write of every weight per micro-batch saved, and the product kept in
fp32 rather than rounded to bf16 first). megatron-core calls apex's ``fused_weight_gradient_mlp_cuda``
for it; without apex, :class:`TorchWgradAccumulation` does the same with one cuBLAS GEMM whose
fp32 output is accumulated in place (``torch.addmm`` with ``out_dtype``, CUDA only, in recent
torch), checked once on the device before it is used.
"""

from __future__ import annotations

import functools
import weakref

import torch
from megatron.core.jit import jit_fuser
from megatron.core.models.common.embeddings import rope_utils


@jit_fuser
def _rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
               interleaved: bool = False) -> torch.Tensor:
    """Transformer Engine's ``fused_apply_rotary_pos_emb`` as megatron-core calls it: ``t`` [s, b, heads, hn],
    ``freqs`` [s, 1, 1, hn] (radians); megatron-core's own RoPE, compiled."""
    return _rope(t, freqs, interleaved)


_ROPE_TABLES: dict = {}  # (id(freqs), dtype) -> (weakref to freqs, its version, cos, sin with the first half negated)


def _rope_tables(freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(freqs) and sin(freqs) in ``dtype`` (megatron-core's ``(cos(freqs) * 1.0).to(dtype)``: the same values),
    the sines' first half negated, computed once per angles tensor (megatron-core's RoPE module caches it)."""
    key = (id(freqs), dtype)
    hit = _ROPE_TABLES.get(key)
    if hit is not None and hit[0]() is freqs and hit[1] == freqs._version:
        return hit[2], hit[3]
    cos, sin = torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)
    first, second = torch.chunk(sin, 2, dim=-1)
    signed = torch.cat((-first, second), dim=-1)
    if len(_ROPE_TABLES) >= 32:
        _ROPE_TABLES.clear()
    _ROPE_TABLES[key] = (weakref.ref(freqs), freqs._version, cos, signed)
    return cos, signed


def lean_rope(unfused):
    """megatron-core's ``_apply_rotary_pos_emb_bshd`` (``unfused``) with its tables computed once: for the
    half-split rotation of whole heads without scaling, ``t * cos + cat(x2, x1) * sin'`` (sin' the sines with
    their first half negated: ``-x2 * sin`` exactly, as ``_rotate_half`` forms it), else ``unfused`` itself."""
    @functools.wraps(unfused)
    def rope(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool = False,
             multi_latent_attention: bool = False, mscale: float = 1.0) -> torch.Tensor:
        if (rotary_interleaved or multi_latent_attention or mscale != 1.0 or freqs.shape[-1] != t.shape[-1]
                or freqs.requires_grad or torch.compiler.is_compiling()):
            return unfused(t, freqs, rotary_interleaved, multi_latent_attention, mscale)
        cos, signed_sin = _rope_tables(freqs, t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        return (t * cos) + (torch.cat((x2, x1), dim=-1) * signed_sin)

    rope.lean = True
    return rope


def enable_lean_rope() -> None:
    """Put :func:`lean_rope` in megatron-core's slot for its unfused RoPE (idempotent)."""
    if not getattr(rope_utils._apply_rotary_pos_emb_bshd, "lean", False):
        rope_utils._apply_rotary_pos_emb_bshd = lean_rope(rope_utils._apply_rotary_pos_emb_bshd)


def enable_rope_fusion() -> str | None:
    """Make megatron-core's ``apply_rope_fusion`` usable: Transformer Engine's kernel if installed, else
    :func:`fused_rope`. Returns None when it is usable, else why not."""
    if not torch.cuda.is_available():
        return "it needs CUDA"
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return None


class TorchWgradAccumulation:
    """apex's ``fused_weight_gradient_mlp_cuda`` in torch: ``main_grad += grad_output^T @ total_input``.

    ``total_input`` [tokens, in] and ``grad_output`` [tokens, out] in bf16 (or fp16), ``main_grad``
    [out, in] in fp32 (``wgrad_gemm_accum_fp32``) or in their dtype (``wgrad_gemm_accum_fp16``).
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        main_grad.addmm_(grad_output.t(), total_input)


def _torch_accumulation_works(device: torch.device) -> bool:
    """Whether :class:`TorchWgradAccumulation` runs here and accumulates what an fp32 GEMM would."""
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(64, 32, device=device, generator=g).bfloat16()
    dy = torch.randn(64, 16, device=device, generator=g).bfloat16()
    main = torch.randn(16, 32, device=device, generator=g)
    expected = main + dy.float().t() @ x.float()
    try:
        TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, dy, main)
    except (RuntimeError, TypeError, NotImplementedError):  # no out_dtype GEMM in this torch / on this device
        return False
    return bool(torch.allclose(main, expected, rtol=1e-4, atol=1e-4))


def enable_wgrad_accumulation_fusion() -> str | None:
    """Make megatron-core's ``gradient_accumulation_fusion`` usable on this CUDA device: apex's kernel if
    installed, else :class:`TorchWgradAccumulation` if it works here. Returns None when it is usable, else
    why not (then leave the fusion off)."""
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:
        return None
    if not torch.cuda.is_available():
        return "it needs CUDA"
    if not _torch_accumulation_works(torch.device("cuda", torch.cuda.current_device())):
        return (f"neither apex nor a torch GEMM with fp32 accumulation into an existing buffer (torch.addmm with "
                f"out_dtype) is available in torch {torch.__version__}")
    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True
    return None
