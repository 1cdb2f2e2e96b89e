"""Context parallelism's module checks on 4 ranks (tests/test_context_parallel.py launches this through
conftest.launch, ranks forked from a process that imported megatron-core once): at CP=4, then CP=2 x DP2,

- the SDPA attention against softmax attention written out on the whole sequence, fp64, GQA, causal and under
  a --reset-attention-mask mask, plain and under megatron-core's selective-recompute checkpoint (with the
  storage of every tensor kept for backward);
- a quantized linear on this rank's tokens against the same GEMMs on the whole batch, with and without the
  CP amax reduction.

Writes rank{RANK}.pt into $CP_CHECKS_OUT.
"""

import dataclasses
import os

import torch
from conftest import run_config

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 32, 2, 4, 2, 8  # GQA: 2 query heads per kv head


def _reference(q, k, v, allowed, scale):
    """Softmax attention written out, [s, b, n, hn] in and out (kv heads repeated per query group)."""
    k, v = (t.repeat_interleave(q.size(2) // t.size(2), dim=2) for t in (k, v))
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(q.size(0), q.size(1), -1)


def _reset_mask() -> torch.Tensor:
    """megatron's --reset-attention-mask mask (True = masked): causal, documents restart at 5, 13 and 22."""
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    for start in (5, 13, 22):
        allowed[start:, :start] = False
    return (~allowed).expand(BATCH, 1, SEQ, SEQ)


def _on_this_rank(t: torch.Tensor) -> torch.Tensor:
    """This CP rank's rows of a sequence-first tensor, cut by megatron-core's own function."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank({"t": t.transpose(0, 1)})["t"].transpose(0, 1)


def _attention_checks(config) -> dict:
    """Max |difference| of output, dq, dk, dv from the reference, per case, on this rank."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_snip.model.attention import SDPAttention

    g = torch.Generator().manual_seed(11)
    full = [torch.randn(SEQ, BATCH, n, HEAD_DIM, generator=g, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS)]
    grad_out = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=g, dtype=torch.float64)
    module = SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    out = {}
    for case, mask in (("causal", None), ("mask", _reset_mask())):
        want_inputs = [t.clone().requires_grad_() for t in full]
        want = _reference(*want_inputs, causal if mask is None else ~mask, module.softmax_scale)
        want.backward(grad_out)
        wants = [want.detach(), *(t.grad for t in want_inputs)]
        local_mask = None if mask is None else get_batch_on_this_cp_rank({"attention_mask": mask})["attention_mask"]
        for recompute in (False, True):
            inputs = [_on_this_rank(t).requires_grad_() for t in full]
            saved = []  # elements of the storage behind each tensor kept for backward (a slice keeps all of it)

            def keep(t, saved=saved):
                saved.append(t.untyped_storage().nbytes() // t.element_size())
                return t

            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                if recompute:  # what megatron's SelfAttention does under --recompute-granularity selective
                    got = tensor_parallel.checkpoint(module, False, *inputs, local_mask)
                else:
                    got = module(*inputs, local_mask)
            got.backward(_on_this_rank(grad_out))
            gots = [got.detach(), *(t.grad for t in inputs)]
            name = f"{case}{'_recompute' if recompute else ''}"
            out[name] = max((a - _on_this_rank(b)).abs().max().item() for a, b in zip(gots, wants))
            out[f"{name}_largest_saved"] = max(saved)
    return out


QUANT_SEQ, QUANT_BATCH, QUANT_FEATURES = 256, 4, 32  # CP4: chunks of 32 x 4 = 128 tokens, fp8 blockwise's block
QUANT_FORMATS = ("fp8", "fp8:delayed", "fp8:rowwise", "fp8:blockwise", "nvfp4", "mxfp4")  # the test's list


def _quantization_checks(config) -> dict:
    """A quantized linear (TP1) on this CP rank's tokens against the same GEMMs on the whole batch: outputs,
    input gradients and the CP-summed weight gradient, relative to their largest element, per format; and the
    same without the CP amax reduction (which must differ, else the check proves nothing)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.model.quantized.layers import QuantizedColumnParallelLinear
    from megatron_snip.numerics.linear import QuantState, quantized_linear
    from megatron_snip.numerics.recipes import Precision, RecipeConfig

    g = torch.Generator().manual_seed(5)
    # Magnitudes growing along the sequence by 2^8: each CP rank's amaxes (per tensor, per row) lie binades apart.
    growth = (2.0 ** (8 * torch.arange(QUANT_SEQ) / QUANT_SEQ)).view(-1, 1, 1)
    x = torch.randn(QUANT_SEQ, QUANT_BATCH, QUANT_FEATURES, generator=g) * growth
    dy = torch.randn(QUANT_SEQ, QUANT_BATCH, QUANT_FEATURES, generator=g) * growth.flip(0)
    weight = torch.randn(QUANT_FEATURES, QUANT_FEATURES, generator=g) / QUANT_FEATURES ** 0.5
    recipe = RecipeConfig(fp4_stochastic_rounding=False, kernels="torch", fp8_gemm="emulated")  # Hadamard on
    layer = QuantizedColumnParallelLinear(QUANT_FEATURES, QUANT_FEATURES, config=dataclasses.replace(
        config, params_dtype=torch.float32), init_method=torch.nn.init.zeros_, bias=False)
    layer.set_recipe(recipe)
    with torch.no_grad():
        layer.weight.copy_(weight)
    cp = parallel_state.get_context_parallel_group()

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    out = {}
    for name in QUANT_FORMATS:
        precision, state = Precision.uniform(name), QuantState()
        for _ in range(2):  # the second step: delayed scaling's scales come from the first one's amaxes
            want_x, want_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
            want = quantized_linear(want_x, want_w, precision, recipe, state)
            want.backward(dy)
        for reduced in (True, False):
            layer.precision = precision
            layer.quant_state = QuantState()
            if not reduced:
                layer.token_amax_all_reduce = lambda amax: amax  # this rank's tokens' amaxes only
            for _ in range(2):
                layer.weight.grad = None
                got_x = _on_this_rank(x).requires_grad_()
                got, _ = layer(got_x)
                got.backward(_on_this_rank(dy))
            if not reduced:
                del layer.token_amax_all_reduce  # the class's method again
            dw = layer.weight.grad.clone()
            dist.all_reduce(dw, group=cp)
            out[(name, reduced)] = max(rel(got.detach(), _on_this_rank(want.detach())),
                                       rel(got_x.grad, _on_this_rank(want_x.grad)), rel(dw, want_w.grad))
    return out


def main() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_snip.compat.cpu import enable
    from megatron_snip.model.llama import transformer_config

    enable()
    dist.init_process_group("gloo")  # env:// (the launcher's rendezvous variables)
    run = run_config("--hidden-size", str(HEADS * HEAD_DIM), "--num-attention-heads", str(HEADS),
                     "--num-query-groups", str(GROUPS), "--seq-length", str(SEQ))
    results = {}
    for cp in (4, 2):
        parallel_state.initialize_model_parallel(context_parallel_size=cp)
        config = dataclasses.replace(transformer_config(run.model, run.parallel), context_parallel_size=cp)
        results[cp] = _attention_checks(config)
        results[cp]["quantization"] = _quantization_checks(config)
        parallel_state.destroy_model_parallel()
    results["local_kv_numel"] = {cp: SEQ // cp * BATCH * GROUPS * HEAD_DIM for cp in results}
    results["q_per_kv_head"] = HEADS // GROUPS
    torch.save(results, os.path.join(os.environ["CP_CHECKS_OUT"], f"rank{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()


