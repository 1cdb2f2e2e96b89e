"""Context parallelism's attention against plain causal SDPA, on one device, in one process.

    python bench/cp_attention.py                 # sequence 8192, Llama-3-8B's heads (32, 8 kv, 128), CP 2, bf16
    python bench/cp_attention.py --seq-length 64 --heads 4 --groups 2 --head-dim 16 --reps 2   # a CPU smoke run

A CP rank's attention (``SDPAttention.attend`` with the rank's chunk layout: one SDPA call per local query
chunk over the keys up to its end, lower-right causal) runs on the keys and values its all-gather hands it.
Here every rank's share runs in turn on this device, forward and backward, on the whole sequence's keys
and values (no communication: the all-gather's cost is the CP group's links, docs/parallel.md), against
one causal SDPA call over the whole sequence, the same FLOPs, timed in the same process:

- speed = plain seconds / the ranks' summed seconds (1.0: the chunking costs nothing);
- balance = the slowest rank's seconds / (plain seconds / CP) (1.0: each rank does an equal share).

Before timing, the output and the query, key and value gradients of both are compared with fp32 causal
SDPA over the whole sequence (largest difference relative to the largest element). On CUDA torch's
quadratic math kernel is forbidden (``sdpa_kernel``: flash and memory-efficient only), so a fallback
fails instead of being timed. ``tests/test_context_parallel.py`` runs :func:`measure` at small sizes.
"""

from __future__ import annotations

import argparse
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from results import goal, write_json
from timing import device_name, median_seconds

from megatron_snip.model.context_parallel import ChunkLayout

SPEED_GOAL = 0.8  # ours: the chunked calls lose at most a fifth against one causal call


def attention_module(heads: int, groups: int, head_dim: int):
    """The SDPA core attention of one TP rank holding ``heads`` query and ``groups`` kv heads, outside any
    process group (its ``attend`` takes the CP layout as an argument)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_snip.model.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, attention_dropout=0.0)
    return SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                        pg_collection=ProcessGroupCollection(tp=None, cp=None))


def _fused_only(device: torch.device):
    """On CUDA: SDPA may run flash or memory-efficient attention, never the math kernel."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])


def measure(seq: int, batch: int, heads: int, groups: int, head_dim: int, cp: int, dtype: torch.dtype,
            device: torch.device, reps: int = 10, warmup: int = 2) -> dict:
    """Seconds of forward + backward of plain causal attention and of each CP rank's share, and their
    differences from fp32 causal attention (see the module docstring). [seq, batch, heads, head_dim] queries."""
    module = attention_module(heads, groups, head_dim)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(seq, batch, n, head_dim, generator=g, device=device, dtype=dtype).requires_grad_()
               for n in (heads, groups, groups))
    grad = torch.randn(seq, batch, heads * head_dim, generator=g, device=device, dtype=dtype)
    layouts = [ChunkLayout(cp, r) for r in range(cp)]

    def plain():
        out = module.attend(q, k, v, None, ChunkLayout(1, 0))
        out.backward(grad)
        return [out]

    def rank(layout: ChunkLayout):
        out = module.attend(layout.local(q), k, v, None, layout)
        out.backward(layout.local(grad))
        return out

    def ranks():
        return [rank(layout) for layout in layouts]

    # fp32 causal SDPA over the whole sequence, kv heads expanded (any fused kernel takes that)
    q32, k32, v32 = (t.detach().float().permute(1, 2, 0, 3).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, *(t.repeat_interleave(heads // groups, dim=1) for t in (k32, v32)),
                                         is_causal=True, scale=module.softmax_scale).permute(2, 0, 1, 3)
    ref = ref.reshape(seq, batch, -1)
    ref.backward(grad.float())
    scale = [t.abs().max() for t in (ref, q32.grad, k32.grad, v32.grad)]

    def worst(run, outputs_of) -> float:
        """The largest difference of ``run``'s outputs (their parts of the whole, ``outputs_of``) and of the
        query, key and value gradients from the reference, relative to the reference's largest element."""
        for t in (q, k, v):
            t.grad = None
        outs = run()
        diffs = [max((got.float() - want).abs().max().item() for got, want in zip(outs, outputs_of(ref.detach())))]
        diffs += [(t.grad.float() - w.grad.permute(2, 0, 1, 3)).abs().max().item() for t, w in zip((q, k, v),
                                                                                                   (q32, k32, v32))]
        return max(d / m.item() for d, m in zip(diffs, scale))

    with _fused_only(device):
        errors = {"plain": worst(plain, lambda t: [t]),
                  "cp": worst(ranks, lambda t: [layout.local(t) for layout in layouts])}
        plain_s = median_seconds(plain, device, reps, warmup)
        ranks_s = [median_seconds(lambda layout=layout: rank(layout), device, reps, warmup) for layout in layouts]
    return {"plain_s": plain_s, "ranks_s": ranks_s, "speed": plain_s / sum(ranks_s),
            "balance": max(ranks_s) / (plain_s / cp), "errors_vs_fp32": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads of one TP rank")
    parser.add_argument("--groups", type=int, default=8, help="kv heads of one TP rank")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size whose chunk layout runs")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--reps", type=int, default=10, help="timed calls (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the results here (for bench/gpu_suite.py)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    shape = (f"sequence {args.seq_length} x batch {args.batch}, {args.heads} heads ({args.groups} kv) x "
             f"{args.head_dim}, {dtype}, CP {args.cp}")
    print(f"context-parallel attention vs plain causal SDPA: {shape} ({device_name()}), torch {torch.__version__}")
    got = measure(args.seq_length, args.batch, args.heads, args.groups, args.head_dim, args.cp, dtype, device,
                  args.reps)
    print(f"plain causal SDPA, forward + backward: {got['plain_s'] * 1e3:.3f} ms")
    shares = ", ".join(f"rank {r} {s * 1e3:.3f} ms" for r, s in enumerate(got["ranks_s"]))
    print(f"CP {args.cp} ranks' shares: {shares}; sum {sum(got['ranks_s']) * 1e3:.3f} ms")
    print(f"speed (plain / CP sum): {got['speed']:.3f}; balance (slowest rank / (plain / CP)): {got['balance']:.3f}")
    print("largest difference from fp32 SDPA, relative to the largest element (output, dq, dk, dv): "
          f"plain {got['errors_vs_fp32']['plain']:.2e}, CP {got['errors_vs_fp32']['cp']:.2e}")
    write_json(args.json, {"benchmark": "cp_attention", "device": device_name(), "shape": shape, **got,
                           "goals": [goal(f"CP {args.cp} attention's speed vs plain causal SDPA, same work "
                                          f"(ours)", got["speed"], at_least=SPEED_GOAL)]})


if __name__ == "__main__":
    main()
