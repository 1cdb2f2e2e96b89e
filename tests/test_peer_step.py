"""bench/peer_step.py, the plain-PyTorch yardstick: its model is the trainer's Llama (same parameters, same
FLOP count), its pieces compute what they claim, and it trains, eager, compiled and in torchao's float8
alike (on CPU: tiny shapes, the aot_eager backend), recording the conditions it ran under. The script itself
runs in tests/test_bench_steps.py, beside our trainer's."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import peer_step
from peer_step import PeerConfig

from megatron_snip.model.presets import LlamaShape

CPU = torch.device("cpu")
SHAPE = LlamaShape(num_layers=2, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
                   seq_length=32, max_position_embeddings=32)
TINY = PeerConfig(SHAPE, vocab_size=256, num_microbatches=2)


@pytest.mark.parametrize("preset, overrides", [("tinyllama-1.1b", {}),
                                               ("llama3-8b", {"num_layers": 4, "seq_length": 4096})])
def test_the_peer_is_the_trainers_llama_in_parameters_and_flops(preset, overrides):
    from megatron_snip.model.config import ModelConfig
    from megatron_snip.model.llama import flops_per_token, num_parameters
    from megatron_snip.model.presets import PRESETS

    config = PeerConfig.from_preset(preset, **overrides)
    shape = {**PRESETS[preset].as_args(), **overrides}
    model = ModelConfig(**{k: shape[k] for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                 "num_attention_heads", "num_query_groups", "seq_length")},
                        share_embeddings_and_output_weights=False)
    with torch.device("meta"):
        peer = peer_step.Transformer(config.shape, 2048)
    assert sum(p.numel() for p in peer.parameters()) == num_parameters(model, 2048)
    assert config.flops_per_iteration() == flops_per_token(model, 2048) * 8 * shape["seq_length"]
    assert config.shape.rotary_base == PRESETS[preset].rotary_base and config.num_microbatches == 8
    assert config.vocab_size == 2048 and config.shape.max_position_embeddings == shape["seq_length"]


def test_rope_rotates_pairs_so_scores_depend_only_on_the_offset():
    g = torch.Generator().manual_seed(0)
    head_dim, seq = 16, 12
    cos, sin = peer_step.rope_tables(head_dim, seq, 10000.0)
    q, k = torch.randn(2, head_dim, generator=g, dtype=torch.float64).float().unbind()

    def at(x, pos):
        return peer_step.apply_rope(x.expand(1, seq, 1, head_dim), cos, sin)[0, pos, 0]

    torch.testing.assert_close(at(q, 5).norm(), q.norm())  # a rotation
    torch.testing.assert_close(at(q, 0), q)  # position 0 is the identity
    torch.testing.assert_close(at(q, 7) @ at(k, 3), at(q, 4) @ at(k, 0), rtol=1e-5, atol=1e-5)
    # pair i rotates by pos * base^(-2i / head_dim): the first pair by pos radians
    x = torch.zeros(head_dim)
    x[0] = 1.0
    torch.testing.assert_close(at(x, 3)[[0, head_dim // 2]], torch.tensor([math.cos(3), math.sin(3)]))


def test_attention_is_causal_grouped_query_attention():
    """The module's output against attention written out: softmax(q k^T / sqrt(d) + causal mask) v, each
    query head reading its group's key/value head."""
    torch.manual_seed(0)
    attention = peer_step.Attention(SHAPE)
    b, s, h, kvh, d = 2, 6, SHAPE.num_attention_heads, SHAPE.num_query_groups, peer_step.head_dim(SHAPE)
    x = torch.randn(b, s, SHAPE.hidden_size)
    cos, sin = peer_step.rope_tables(d, s, SHAPE.rotary_base)
    q = peer_step.apply_rope(attention.wq(x).view(b, s, h, d), cos, sin)
    k = peer_step.apply_rope(attention.wk(x).view(b, s, kvh, d), cos, sin)
    v = attention.wv(x).view(b, s, kvh, d)
    out = torch.empty(b, s, h, d)
    mask = torch.ones(s, s).tril().bool()
    for head in range(h):
        group = head // (h // kvh)
        scores = (q[:, :, head] @ k[:, :, group].transpose(1, 2)) / math.sqrt(d)
        out[:, :, head] = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v[:, :, group]
    torch.testing.assert_close(attention(x, cos, sin), attention.wo(out.reshape(b, s, h * d)))


def test_eager_trains_and_the_compiled_blocks_compute_the_same_steps():
    losses = {}
    for variant in ("eager", "compiled"):
        model, optimizer = peer_step.build(TINY, variant, CPU, backend="aot_eager")
        batches = peer_step.random_batches(TINY, CPU)
        losses[variant] = [peer_step.train_step(model, optimizer, batches).item() for _ in range(4)]
        if variant == "compiled":
            assert all(hasattr(block, "_orig_mod") for block in model.layers.values())
    eager, compiled = losses["eager"], losses["compiled"]
    assert abs(eager[0] - math.log(TINY.vocab_size)) < 0.1  # a fresh model guesses uniformly
    assert eager[-1] < eager[0] - 0.1, eager  # the same batch, four AdamW steps
    assert compiled == pytest.approx(eager, rel=1e-4)


def test_torchao_float8_converts_every_linear_but_the_output_layer_and_trains():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    model, optimizer = peer_step.build(TINY, "float8-rowwise", CPU, backend="aot_eager")
    block = model.layers["0"]._orig_mod
    linears = [block.attention.wq, block.attention.wk, block.attention.wv, block.attention.wo,
               block.feed_forward.w1, block.feed_forward.w2, block.feed_forward.w3]
    assert all(isinstance(m, Float8Linear) for m in linears) and type(model.output) is torch.nn.Linear
    batches = peer_step.random_batches(TINY, CPU)
    losses = [peer_step.train_step(model, optimizer, batches).item() for _ in range(4)]  # torch's CPU _scaled_mm
    assert losses[-1] < losses[0] - 0.1, losses
    assert peer_step.float8_available(CPU) == "no FP8 tensor cores on this device (CUDA capability >= 8.9 needed)"


def test_shape_overrides_and_the_conditions_a_variant_runs_under():
    """The preset's fields overridden as pretrain_llama.py's flags override them, and each variant's conditions
    in the form bench/side_by_side.py compares with our trainer's."""
    config = PeerConfig.from_preset("tiny", 1, 64, hidden_size=1024, ffn_hidden_size=2816, num_attention_heads=8,
                                    num_query_groups=4, num_microbatches=4, bf16=True)
    s = config.shape
    assert (s.num_layers, s.hidden_size, s.ffn_hidden_size, s.num_attention_heads, s.num_query_groups,
            s.seq_length, s.max_position_embeddings) == (1, 1024, 2816, 8, 4, 64, 64)
    assert (config.num_microbatches, config.bf16, config.vocab_size) == (4, True, 2048)
    assert PeerConfig.from_preset("tiny", hidden_size=None).shape == peer_step.PRESETS["tiny"]
    threads = torch.get_num_threads()
    eager = config.run_conditions("eager", "inductor").to_dict()
    assert eager == {"device": "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name(),
                     "processes": 1, "threads_per_process": threads, "dtype": "bf16", "compile": "eager",
                     "recompute": "none", "model": "1 layers x 1024, ffn 2816, 8 heads / 4 groups, vocab 2048",
                     "seq_length": 64, "micro_batch_size": 1, "num_microbatches": 4,
                     "flops_per_iteration": config.flops_per_iteration()}
    assert config.run_conditions("compiled", "inductor").compile == "inductor"
    assert config.run_conditions("float8-rowwise", "inductor").dtype == "fp8"


def test_gradients_are_clipped_to_norm_one_as_torchtitan_and_our_trainer_clip():
    model, optimizer = peer_step.build(TINY, "eager", CPU)
    batches = peer_step.random_batches(TINY, CPU)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(
        torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()))
    for p in model.parameters():  # gradients far above norm 1
        p.register_hook(lambda g: g * 1e3)
    peer_step.train_step(model, optimizer, batches)
    assert seen == [pytest.approx(peer_step.MAX_NORM, rel=1e-5)]


def test_summary_gives_tflops_mfu_and_the_float8_speedup_over_compiled():
    config = PeerConfig.from_preset("tinyllama-1.1b")
    flops = config.flops_per_iteration()
    measured = {"compiled": {"seconds": 0.4, "warmup_seconds": 9.0, "losses": [7.6], "peak_gib": 20.0},
                "float8-tensorwise": {"seconds": 0.32, "warmup_seconds": 12.0, "losses": [7.6], "peak_gib": 19.0},
                "float8-rowwise": {"skipped": "torchao does not import"}}
    lines, figures = peer_step.summarise(config, measured, peak_tflops=1000.0)
    assert figures["variants"]["compiled"]["tflops"] == pytest.approx(flops / 0.4 / 1e12)
    assert figures["variants"]["compiled"]["mfu"] == pytest.approx(flops / 0.4 / 1e15)
    assert figures["float8-tensorwise_speedup"] == pytest.approx(1.25)
    text = "\n".join(lines)
    assert "peer float8-rowwise    : skipped (torchao does not import)" in text
    assert "float8-tensorwise speed-up over compiled bf16: 1.250x" in text
