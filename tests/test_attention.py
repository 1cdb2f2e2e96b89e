"""--attention-backend: torch's SDPA core attention (megatron_snip/model/attention.py) against
megatron-core's DotProductAttention.

The unit tier checks the wiring (flag -> spec / TransformerConfig, the checkpoint shape) and the
refusals. One spawned gloo process compares the two modules alone (GQA, the softmax scale, a
megatron boolean mask, dropout's RNG) and whole TP1 models built with each backend (state-dict
keys, loss, gradients); torchrun runs compare training at TP2 + sequence parallelism and PP2.

Tolerances: both compute the same fp32 function; only the order of the reductions differs
(SDPA's tiled online softmax against a full-row softmax): ~1e-7 relative in the module, 1e-5
allowed; the layout runs use test_parallel.py's bounds (losses 2e-5 relative, every gradient
within 1e-4 of its tensor's largest element).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, run_config
from test_parallel import assert_close, losses_and_grads

BACKENDS = ("flash", "fused", "unfused", "local", "auto")
SEQ, BATCH = 32, 3
GQA_FLAGS = ("--hidden-size", "128", "--num-attention-heads", "8", "--num-query-groups", "2")  # 4 heads per kv head


# ----------------------------------------------------------------------------------------------
# Unit tier: the flag, the spec, the config, the checkpoint shape, the refusals


def _core_attention(backend: str) -> type:
    from megatron_snip.model.llama import layer_spec

    return layer_spec("local", backend).submodules.self_attention.submodules.core_attention


def test_local_spec_core_attention_follows_the_flag():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_snip.model.attention import SDPAttention

    assert run_config().model.attention_backend == "auto"  # Megatron-LM's default
    picked = {b: _core_attention(run_config("--attention-backend", b).model.attention_backend) for b in BACKENDS}
    assert picked == {"flash": SDPAttention, "fused": SDPAttention, "auto": SDPAttention,
                      "unfused": DotProductAttention, "local": DotProductAttention}


def test_transformer_engine_gets_the_backend_in_its_config():
    from megatron.core.transformer.enums import AttnBackend

    from megatron_snip.model.llama import transformer_config

    for backend in BACKENDS:
        run = run_config("--attention-backend", backend)
        te = dataclasses.replace(run.model, transformer_impl="transformer_engine")
        assert transformer_config(te, run.parallel).attention_backend == AttnBackend[backend]
        # The local layers choose their class in the spec; the config keeps megatron-core's default.
        assert transformer_config(run.model, run.parallel).attention_backend == AttnBackend.auto


def test_backend_is_not_part_of_the_checkpoint_shape():
    from megatron_snip.arguments import checkpoint_config
    from megatron_snip.model import checkpoint_shape

    saved = run_config("--attention-backend", "unfused").to_flags()
    assert not {"attention_backend"} & {*checkpoint_shape.FIXED, *checkpoint_shape.DEFAULTS, *checkpoint_shape.CARRIED}
    # A checkpoint trained with one backend is read with the flag's value, not the saved one.
    assert checkpoint_config(saved, bf16=False).model.attention_backend == "auto"


@pytest.mark.parametrize("change,message", [
    ({"softmax_type": "off-by-one"}, "softmax_type 'off-by-one'"),
    ({"window_size": (16, 0)}, "sliding-window attention"),
], ids=["softmax-offset", "sliding-window"])
def test_unsupported_configurations_are_refused(change, message):
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_snip.model.attention import SDPAttention
    from megatron_snip.model.llama import transformer_config

    run = run_config()
    config = dataclasses.replace(transformer_config(run.model, run.parallel), **change)
    with pytest.raises(ValueError, match=message):
        SDPAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


# ----------------------------------------------------------------------------------------------
# One process: the modules alone and whole TP1 models (megatron-core needs its CPU layer: a worker)


def _modules(config, layer_number=1):
    """(DotProductAttention, SDPAttention) built as megatron's SelfAttention builds its core attention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_snip.model.attention import SDPAttention

    return tuple(cls(config=config, layer_number=layer_number, attn_mask_type=AttnMaskType.causal,
                     attention_type="self", softmax_scale=config.softmax_scale) for cls in (DotProductAttention,
                                                                                             SDPAttention))


def _qkv(config, seed=0):
    """query [s, b, heads, hn], key and value [s, b, groups, hn], needing gradients."""
    g = torch.Generator().manual_seed(seed)
    hn = config.kv_channels
    shapes = [(SEQ, BATCH, config.num_attention_heads, hn)] + [(SEQ, BATCH, config.num_query_groups, hn)] * 2
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _fwd_bwd(module, qkv, mask=None):
    """Output and the input gradients of a fixed random output gradient."""
    qkv = [t.detach().clone().requires_grad_() for t in qkv]
    out = module(*qkv, mask)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)))
    return [out.detach()] + [t.grad for t in qkv]


def _rel_diff(a: list, b: list) -> float:
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


def _reset_mask() -> torch.Tensor:
    """megatron's --reset-attention-mask mask (True = masked): causal, documents restart at 11 and 20."""
    allowed = torch.ones(SEQ, SEQ).tril()
    for start in (11, 20):
        allowed[start:, :start] = 0
    return (allowed < 0.5).expand(BATCH, 1, SEQ, SEQ)


def module_checks(config) -> dict:
    """SDPA vs DotProductAttention alone, in fp32, at TP1 (GQA: 4 query heads per kv head)."""
    from megatron.core import tensor_parallel
    from megatron.core.packed_seq_params import PackedSeqParams

    out = {}
    qkv = _qkv(config)
    dpa, sdpa = _modules(config)
    out["plain"] = _rel_diff(_fwd_bwd(sdpa, qkv), _fwd_bwd(dpa, qkv))
    out["mask"] = _rel_diff(_fwd_bwd(sdpa, qkv, _reset_mask()), _fwd_bwd(dpa, qkv, _reset_mask()))
    # --apply-query-key-layer-scaling (layer 3) and an explicit softmax scale
    scaled = dataclasses.replace(config, softmax_scale=0.07, apply_query_key_layer_scaling=True)
    dpa, sdpa = _modules(scaled, layer_number=3)
    out["scale"] = _rel_diff(_fwd_bwd(sdpa, qkv), _fwd_bwd(dpa, qkv))
    out["unscaled_differs"] = _rel_diff(_fwd_bwd(_modules(config)[1], qkv), _fwd_bwd(sdpa, qkv))
    # Dropout (training mode): same tracker seed, same bits; the draw comes from the tracker's stream.
    dropped = _modules(dataclasses.replace(config, attention_dropout=0.3))[1]
    runs = []
    for seed in (5, 5, 6):
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        default = torch.get_rng_state()
        runs.append(_fwd_bwd(dropped, qkv))
        out.setdefault("default_stream_untouched", []).append(torch.equal(default, torch.get_rng_state()))
    out["dropout_repeats"] = all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    out["dropout_seed_changes"] = not torch.equal(runs[0][0], runs[2][0])
    out["dropout_vs_none"] = _rel_diff(runs[0], _fwd_bwd(_modules(config)[1], qkv))
    dropped.eval()
    out["dropout_eval"] = _rel_diff(_fwd_bwd(dropped, qkv), _fwd_bwd(_modules(config)[0], qkv))
    errors = {}
    for name, call in {
        "float_mask": lambda: sdpa(*qkv, torch.zeros(BATCH, 1, SEQ, SEQ)),
        "packed": lambda: sdpa(*qkv, None, packed_seq_params=PackedSeqParams()),
    }.items():
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def model_checks() -> dict:
    """TP1 GPT models built by the trainer's builders with each backend, from the same seeds."""
    from megatron.core import tensor_parallel

    from megatron_snip.model.llama import build_model, transformer_config

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, SEQ + 1), generator=g)
    positions = torch.arange(SEQ).expand(2, SEQ)
    out = {}
    for backend in ("unfused", "auto"):
        run = run_config(*GQA_FLAGS, "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
                         "--attention-backend", backend)
        torch.manual_seed(123)
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        config = transformer_config(run.model, run.parallel)
        (model,) = build_model(run.model, run.parallel, config, 128)
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        out[backend] = {"keys": sorted(model.state_dict()), "sharded_keys": sorted(model.sharded_state_dict()),
                        "loss": loss.item(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                        "core": type(model.decoder.layers[0].self_attention.core_attention).__name__}
    return out


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_snip.compat.cpu import enable
    from megatron_snip.model.llama import transformer_config

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    run = run_config(*GQA_FLAGS)
    results = {"module": module_checks(transformer_config(run.model, run.parallel)), "model": model_checks()}
    torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention")
    mp.spawn(worker, args=(1, free_port(), str(out)), nprocs=1, join=True)
    return torch.load(out / "results.pt")


@pytest.mark.integration
def test_module_equals_dot_product_attention_with_gqa(results):
    """Outputs and query/key/value gradients, causal and under a --reset-attention-mask mask."""
    module = results["module"]
    assert module["plain"] < 1e-5 and module["mask"] < 1e-5


@pytest.mark.integration
def test_module_uses_megatrons_softmax_scale(results):
    module = results["module"]
    assert module["scale"] < 1e-5  # config.softmax_scale, with query-key layer scaling
    assert module["unscaled_differs"] > 0.1  # so the scale was not the default 1/sqrt(hn) by accident


@pytest.mark.integration
def test_dropout_draws_from_megatrons_tracker(results):
    module = results["module"]
    assert module["dropout_repeats"] and module["dropout_seed_changes"]
    assert module["default_stream_untouched"] == [True, True, True]  # the TP-rank fork, as DotProductAttention
    assert module["dropout_vs_none"] > 0.1  # it drops
    assert module["dropout_eval"] < 1e-5  # and only in training: eval equals the unfused module


@pytest.mark.integration
def test_module_refuses_what_it_cannot_compute(results):
    errors = results["module"]["errors"]
    assert "boolean [b, 1, sq, sk]" in errors["float_mask"] and "torch.float32" in errors["float_mask"]
    assert "packed sequences" in errors["packed"]


@pytest.mark.integration
def test_models_of_both_backends_share_checkpoints_and_train_alike(results):
    unfused, sdpa = results["model"]["unfused"], results["model"]["auto"]
    assert (unfused["core"], sdpa["core"]) == ("DotProductAttention", "SDPAttention")
    assert unfused["keys"] == sdpa["keys"] and unfused["sharded_keys"] == sdpa["sharded_keys"]
    assert not any("core_attention" in k for k in sdpa["keys"])
    assert sdpa["loss"] == pytest.approx(unfused["loss"], rel=1e-6)
    for name, grad in unfused["grads"].items():
        assert (sdpa["grads"][name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


# ----------------------------------------------------------------------------------------------
# Training under torchrun: SDPA vs DotProductAttention in the same parallel layout


@pytest.mark.integration
@pytest.mark.parametrize("layout", [
    ("--tensor-model-parallel-size", "2", "--sequence-parallel"),
    ("--pipeline-model-parallel-size", "2"),
], ids=["tp2-sp", "pp2"])
def test_sdpa_trains_as_dot_product_attention(tiny_data, init_ckpt, tmp_path, layout):
    """Losses of 4 steps from the same weights, then every gradient of a 5th batch. The initial
    checkpoint was saved by an SDPA run (the default) and loads into the unfused one."""
    runs = {}
    for backend in ("unfused", "auto"):
        (tmp_path / backend).mkdir()
        runs[backend] = losses_and_grads(tiny_data, init_ckpt, tmp_path / backend, 2, *layout,
                                         "--attention-backend", backend)
    (want_losses, want_grads), (losses, grads) = runs["unfused"], runs["auto"]
    assert_close(losses, want_losses, rel=2e-5)
    assert sorted(grads) == sorted(want_grads)
    worst = {name: ((grads[name] - g).abs().max() / g.abs().max()).item() for name, g in want_grads.items()}
    print(f"\n{' '.join(layout)}: SDPA vs DotProductAttention: max |loss diff| "
          f"{max(abs(losses[k] - want_losses[k]) for k in losses):.2e}; max gradient diff relative to the "
          f"tensor's largest {max(worst.values()):.2e} ({max(worst, key=worst.get)})")
    for name, rel in worst.items():
        assert rel < 1e-4, (name, rel)
