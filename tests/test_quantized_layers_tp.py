"""Quantized megatron-core layers: tensor-parallel parity, the GPT layer spec, the precision controller.

Multi-process parts run as spawned gloo workers (127.0.0.1) that save their
results; the assertions run here. megatron-core runs on CPU through
megatron_snip.compat.cpu, enabled only inside the workers (it changes
process-global state).

Tolerance of the TP=2 vs TP=1 comparison. Quantization is identical on both
layouts (amaxes all-reduced, splits on block boundaries), so only the order
of fp32 accumulation can differ, and only where a GEMM's reduction dim is
split and the partial results are all-reduced: the column-parallel dX
(reduces over out) and the row-parallel Y (reduces over in). For K products
summed in any order in fp32, |fl(sum) - sum| <= gamma_K * sum|a_i b_i| with
gamma_K = K u / (1 - K u), u = 2^-24; two orders differ by at most twice
that. sum|a_i b_i| is computed exactly as the quantized GEMM of |A| and |B|:
every quantizer here (round to nearest, scales from amaxes) is odd-symmetric,
so Q(|a|) = |Q(a)|. Everything else (outputs and gradients whose reduction
dim is not split) must be bit-identical.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, run_config, running_plan

LEAD, OUT = (8, 4), 64  # leading (token) dims of the layer inputs; base width
PRECISIONS = ("nvfp4", "mxfp4", "fp8", "fp8:rowwise")  # precision[:fp8 recipe]
EXACT = {"column": ("y", "dw"), "row": ("dx", "dw")}
SUMMED = {"column": "dx", "row": "y"}  # outputs of an all-reduce over a split reduction dim


def _layout(tp: int = 1, pp: int = 1) -> None:
    """(Re)initialise megatron's parallel groups on the running gloo world."""
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Every multi-process check, in one spawn (process start-up and imports dominate the time)."""
    import torch.distributed as dist

    from megatron_snip.compat.cpu import enable

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    _layout(tp=world)
    results["parity"] = layer_parity(rank, world)
    results["parity_sp"] = layer_parity(rank, world, sequence_parallel=True)
    results["layer_alignment"] = layer_alignment(world)
    results["tp_model"] = tp_model_alignment()
    _layout(pp=world)
    results["pp_names"] = [None] * world
    dist.all_gather_object(results["pp_names"], pp_module_names())
    _layout()  # data parallel: both ranks run the same single-process checks
    results["gpt"] = gpt_training()
    results["recipes"] = mixed_recipe_bits()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "results.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out / "results.pt")


# ----------------------------------------------------------------------------------------------
# TP=2 vs TP=1 parity of single layers


def _layer_case(kind, precision, tp_group, world, sequence_parallel=False):
    """A layer of ``kind`` on ``tp_group`` (weights are copied in by :func:`_run_layer`)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_snip.model.quantized.layers import QuantizedColumnParallelLinear, QuantizedRowParallelLinear
    from megatron_snip.numerics.recipes import Precision, RecipeConfig

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                 perform_initialization=False, sequence_parallel=sequence_parallel)
    common = dict(config=config, init_method=torch.nn.init.zeros_, bias=False, tp_group=tp_group)
    if kind == "column":
        layer = QuantizedColumnParallelLinear(OUT, 2 * OUT, gather_output=False, **common)
    else:
        layer = QuantizedRowParallelLinear(2 * OUT, OUT, input_is_parallel=True, skip_bias_add=True, **common)
    # Deterministic rounding: stochastic rounding draws per shard, so it is equal in law, not in bits.
    # rowwise: per-row scales along a split reduction dim need the row amaxes of every shard.
    name, _, fp8_recipe = precision.partition(":")
    layer.set_recipe(RecipeConfig(fp4_stochastic_rounding=False, fp8_recipe=fp8_recipe or "tensorwise"))
    layer.precision = Precision.uniform(name)
    return layer


def _run_layer(layer, kind, w_full, x_full, dy_full, rank, world, sequence_parallel=False):
    """(y, dx, dw) of one forward/backward, each gathered to the full tensor. With sequence
    parallelism the column layer's input and the row layer's output are split along the
    sequence (dim 0), as megatron-core's sequence-parallel regions hold them."""
    import torch.distributed as dist

    def shard(t, dim):
        return t.chunk(world, dim=dim)[rank].contiguous()

    def gather(t, dim):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=layer.tp_group)
        return torch.cat(parts, dim=dim)

    split_dim = 0 if kind == "column" else 1  # W (out, in): column splits out, row splits in
    with torch.no_grad():
        layer.weight.copy_(shard(w_full, split_dim))
    sp = sequence_parallel
    if kind == "column":
        x = (shard(x_full, 0) if sp else x_full).clone().requires_grad_()
        y, _ = layer(x)
        y.backward(shard(dy_full, -1))
        return gather(y, -1), gather(x.grad, 0) if sp else x.grad, gather(layer.weight.grad, 0)
    x = shard(x_full, -1).clone().requires_grad_()
    y, _ = layer(x)
    y.backward(shard(dy_full, 0) if sp else dy_full)
    return gather(y, 0) if sp else y, gather(x.grad, -1), gather(layer.weight.grad, 1)


def layer_parity(rank, world, sequence_parallel=False):
    """TP=2 vs TP=1 results per (layer kind, precision); run under TP=world."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    solo = [dist.new_group([r]) for r in range(world)][rank]  # a TP=1 group per rank
    tp_group = parallel_state.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(0)
    results = {}
    for kind in ("column", "row"):
        in_f, out_f = (OUT, 2 * OUT) if kind == "column" else (2 * OUT, OUT)
        w = torch.randn(out_f, in_f, generator=g) * 0.1
        x = torch.randn(*LEAD, in_f, generator=g)
        dy = torch.randn(*LEAD, out_f, generator=g)
        for precision in PRECISIONS:
            tp2 = _run_layer(_layer_case(kind, precision, tp_group, world, sequence_parallel), kind, w, x, dy,
                             rank, world, sequence_parallel)
            one = _layer_case(kind, precision, solo, 1)
            tp1 = _run_layer(one, kind, w, x, dy, 0, 1)
            # sum |a_i b_i| of the split-reduction output: the same GEMM on |operands|
            one.weight.grad = None
            magnitude = _run_layer(one, kind, w.abs(), x.abs(), dy.abs(), 0, 1)
            results[kind, precision] = {"tp2": tp2, "tp1": tp1, "magnitude": magnitude}
    return results


def layer_alignment(world):
    """A 96-wide column-parallel layer at TP=2 (48 per rank): fine for nvfp4's 16, not mxfp4's 32."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_snip.model.quantized.layers import QuantizedColumnParallelLinear
    from megatron_snip.numerics.recipes import Precision

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    narrow = QuantizedColumnParallelLinear(OUT, 96, config=config, init_method=torch.nn.init.zeros_, bias=False)
    narrow.precision = Precision.uniform("nvfp4")
    results = {}
    try:
        narrow.precision = Precision.uniform("mxfp4")
    except ValueError as e:
        results["error"] = str(e)
    results["kept"] = str(narrow.precision)
    return results


@pytest.mark.integration
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_tp2_matches_tp1(results, kind, precision, sequence_parallel):
    """Also with sequence parallelism, which changes the communication around the GEMMs only."""
    r = results["parity_sp" if sequence_parallel else "parity"][kind, precision]
    names = ("y", "dx", "dw")
    tp2, tp1, magnitude = (dict(zip(names, r[k])) for k in ("tp2", "tp1", "magnitude"))
    for name in EXACT[kind]:
        assert torch.equal(tp2[name], tp1[name]), f"{name}: max diff {(tp2[name] - tp1[name]).abs().max()}"
    name = SUMMED[kind]
    k = 2 * OUT  # length of the split reduction dim (out for column dgrad, in for row fprop)
    u = 2.0**-24
    bound = 2 * (k * u / (1 - k * u)) * magnitude[name]
    err = (tp2[name] - tp1[name]).abs()
    assert (err <= bound).all(), f"{name}: error {err.max()} beyond the accumulation-order bound"
    assert not torch.equal(tp1[name], magnitude[name])  # the bound is not trivially the value itself


@pytest.mark.integration
def test_split_not_on_block_boundaries_is_refused(results):
    align = results["layer_alignment"]
    assert "cannot run mxfp4" in align["error"] and "TP=2" in align["error"] and "48 per rank" in align["error"]
    assert align["kept"] == "nvfp4"


# ----------------------------------------------------------------------------------------------
# A tiny GPT model built from precision_layer_spec


def _gpt_config(tp=1, pp=1):
    """The trainer's megatron-core config of a 4-layer hidden-64 Llama at TP x PP."""
    from megatron_snip.model.llama import transformer_config

    run = run_config("--ffn-hidden-size", "160", "--tensor-model-parallel-size", str(tp),
                     "--pipeline-model-parallel-size", str(pp), world_size=tp * pp)
    return transformer_config(run.model, run.parallel)


def _gpt(config, quantized=True):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_snip.model.quantized.layers import precision_layer_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=precision_layer_spec(spec) if quantized else spec,
                    vocab_size=128, max_sequence_length=32,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (4, 33), generator=g)
    return tokens[:, :-1], torch.arange(32).expand(4, 32), tokens[:, 1:]


def _loss(model, batch):
    tokens, positions, labels = batch
    return model(tokens, positions, None, labels=labels).float().mean()


MIXED = {"decoder.layers.1.self_attention.linear_qkv": "fp8", "decoder.layers.1.mlp.linear_fc1": "nvfp4",
         "decoder.layers.1.mlp.linear_fc2": "mxfp4", "decoder.layers.2.self_attention.linear_proj": "nvfp4/bf16",
         "decoder.layers.2.mlp.linear_fc1": "fp8/nvfp4", "decoder.layers.2.mlp.linear_fc2": "nvfp4"}


def gpt_training():
    """Plan switches and 20 Adam steps per plan on one batch, on a single-rank model."""
    from megatron_snip.model.quantized.controller import PrecisionController
    from megatron_snip.numerics.recipes import Precision
    from megatron_snip.precision.plan import PrecisionPlan, module_names

    config = _gpt_config()
    model = _gpt(config)
    init = copy.deepcopy(model.state_dict())
    controller = PrecisionController(model, seed=1)
    out = {"names": controller.module_names(), "expected_names": module_names(4)}
    mixed = PrecisionPlan({k: Precision.parse(v) for k, v in MIXED.items()})
    batch = _batch()

    # Plans apply at once, to the same modules (no rebuild); bf16 is megatron-core's own path.
    plain = _gpt(config, quantized=False)
    plain.load_state_dict(init)
    ids = [id(m) for m in controller.modules().values()]
    with torch.no_grad():
        reference = _loss(plain, batch)
        bf16_loss = _loss(model, batch)
        changed = controller.apply(PrecisionPlan.uniform("nvfp4"))
        nvfp4_loss = _loss(model, batch)
        precisions = [str(m.precision) for m in controller.modules().values()]
        controller.apply(PrecisionPlan.uniform("bf16"))
        back_loss = _loss(model, batch)
    out["switch"] = dict(reference=reference, bf16=bf16_loss, nvfp4=nvfp4_loss, back=back_loss,
                         changed=len(changed), precisions=precisions,
                         same_modules=ids == [id(m) for m in controller.modules().values()])

    for name, plan in (("nvfp4", PrecisionPlan.uniform("nvfp4")), ("mixed", mixed), ("bf16", PrecisionPlan())):
        model.load_state_dict(init)
        controller.apply(plan)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            optimizer.zero_grad()
            loss = _loss(model, batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        out[name] = losses
    out["current"] = running_plan(controller) == PrecisionPlan()
    controller.apply(mixed)
    out["current_mixed"] = running_plan(controller) == mixed
    return out


@pytest.mark.integration
def test_controller_names_every_linear_globally(results):
    gpt = results["gpt"]
    assert gpt["names"] == gpt["expected_names"]
    assert gpt["current"] and gpt["current_mixed"]


@pytest.mark.integration
def test_plan_changes_take_effect_immediately(results):
    s = results["gpt"]["switch"]
    assert torch.equal(s["bf16"], s["reference"]), "bf16 must be megatron-core's own forward"
    assert s["changed"] == 16 and set(s["precisions"]) == {"nvfp4"} and s["same_modules"]
    assert not torch.equal(s["nvfp4"], s["bf16"]) and abs(s["nvfp4"] - s["bf16"]) < 0.05
    assert torch.equal(s["back"], s["bf16"])


@pytest.mark.integration
@pytest.mark.parametrize("plan", ["nvfp4", "mixed"])
def test_quantized_gpt_trains(results, plan):
    losses, bf16 = results["gpt"][plan], results["gpt"]["bf16"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    # Memorising one batch: 4-bit GEMMs cost some loss, not the learning.
    assert losses[-1] < bf16[-1] + 0.5 * (bf16[0] - bf16[-1]), (losses, bf16)


# An FP8 recipe per module: fp8 follows the controller's (the run's) recipe, fp8:RECIPE keeps its own.
RECIPE_PLAN = {"decoder.layers.0.self_attention.linear_qkv": "fp8", "decoder.layers.0.self_attention.linear_proj":
               "fp8:rowwise", "decoder.layers.0.mlp.linear_fc1": "fp8:blockwise", "decoder.layers.0.mlp.linear_fc2":
               "fp8:mxfp8", "decoder.layers.1.self_attention.linear_qkv": "fp8:rowwise/fp8:blockwise",
               "decoder.layers.1.mlp.linear_fc1": "fp8:tensorwise", "decoder.layers.1.mlp.linear_fc2": "fp8"}


def _reference_gemms(x, w, dy, precision, recipe):
    """(y, dx, dw) of ``Y = X W^T`` and its backward GEMMs from the reference quantizers alone: each
    operand quantized and dequantized by ``quantize_dequantize`` as ``operand_quantizer`` says, then fp32
    GEMMs (the emulated path's arithmetic)."""
    from megatron_snip.numerics.blocks import tensor_amax
    from megatron_snip.numerics.fp8 import fp8_scale_from_amax
    from megatron_snip.numerics.quantize import quantize_dequantize
    from megatron_snip.numerics.recipes import operand_quantizer

    def q(t, gemm, operand):
        quantizer = operand_quantizer(precision.fwd if gemm == "fprop" else precision.bwd, gemm, operand, recipe)
        src = t.t() if quantizer.columnwise else t
        scale = fp8_scale_from_amax(tensor_amax(src).float(), quantizer.element) if quantizer.spec.per_tensor \
            else None
        out = quantize_dequantize(src, quantizer, scale=scale)
        return out.t() if quantizer.columnwise else out

    return (q(x, "fprop", "x") @ q(w, "fprop", "w").t(), q(dy, "dgrad", "dy") @ q(w, "dgrad", "w"),
            q(dy, "wgrad", "dy").t() @ q(x, "wgrad", "x"))


def mixed_recipe_bits():
    """A plan of FP8 recipes per module applied by the controller, under the run recipes tensorwise and then
    rowwise: per module, whether its forward output, input gradient and weight gradient equal the reference
    quantizers' of its own recipe (plain fp8: the run's), and of the run's recipe's plain fp8."""
    from megatron_snip.model.quantized.controller import PrecisionController
    from megatron_snip.numerics.recipes import Precision, RecipeConfig
    from megatron_snip.precision.plan import PrecisionPlan

    model = _gpt(_gpt_config())
    controller = PrecisionController(model, seed=1)
    plan = PrecisionPlan({k: Precision.parse(v) for k, v in RECIPE_PLAN.items()})
    captured = {}

    def hook(name):
        def forward_hook(module, inputs, output):
            x, y = inputs[0], output[0]
            record = captured[name] = {"x": x.detach(), "y": y.detach()}
            x.register_hook(lambda g: record.__setitem__("dx", g.detach()))
            y.register_hook(lambda g: record.__setitem__("dy", g.detach()))
        return forward_hook

    modules = controller.modules()
    for name, module in modules.items():
        module.register_forward_hook(hook(name))
    out = {}
    for run_recipe in ("tensorwise", "rowwise"):
        recipe = RecipeConfig(fp8_recipe=run_recipe, kernels="torch")
        controller.set_recipe(recipe)
        controller.apply(plan)
        model.zero_grad(set_to_none=True)
        _loss(model, _batch()).backward()
        for name, text in RECIPE_PLAN.items():
            c, weight = captured[name], modules[name].weight
            got = (c["y"].reshape(-1, c["y"].shape[-1]), c["dx"].reshape(-1, c["dx"].shape[-1]), weight.grad)
            args = (c["x"].reshape(-1, c["x"].shape[-1]), weight.detach(), c["dy"].reshape(-1, c["dy"].shape[-1]))
            own = _reference_gemms(*args, Precision.parse(text), recipe)
            plain = _reference_gemms(*args, Precision.uniform("fp8"), recipe)
            out[run_recipe, name] = {"own": [torch.equal(a, b) for a, b in zip(got, own)],
                                     "run's": [torch.equal(a, b) for a, b in zip(got, plain)]}
    return out


@pytest.mark.integration
def test_a_plan_of_fp8_recipes_runs_each_modules_own_recipe(results):
    """Every module's three GEMMs give the bits of its own recipe's reference quantizers; plain fp8 follows the
    run's recipe when it changes, fp8:RECIPE does not (so its results differ from the run recipe's)."""
    bits = results["recipes"]
    for (run_recipe, name), r in bits.items():
        text = RECIPE_PLAN[name]
        assert r["own"] == [True, True, True], (run_recipe, name, text, r)
        follows_run = text == "fp8" or text == f"fp8:{run_recipe}"
        assert all(r["run's"]) == follows_run, (run_recipe, name, text, r)


def test_precision_layer_spec_replaces_exactly_the_four_linears():
    import dataclasses

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_snip.model.quantized.layers import (
        QuantizedColumnParallelLinear,
        QuantizedRowParallelLinear,
        precision_layer_spec,
    )

    base = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec = precision_layer_spec(base)
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    assert (attn.linear_qkv, attn.linear_proj) == (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)
    assert (mlp.linear_fc1, mlp.linear_fc2) == (QuantizedColumnParallelLinear, QuantizedRowParallelLinear)
    assert attn.core_attention is base.submodules.self_attention.submodules.core_attention
    assert base.submodules.mlp.submodules.linear_fc1 is ColumnParallelLinear, "the base spec is left unchanged"
    assert base.submodules.self_attention.submodules.linear_proj is RowParallelLinear
    assert precision_layer_spec(spec) == spec
    foreign = dataclasses.replace(base, submodules=dataclasses.replace(
        base.submodules, mlp=dataclasses.replace(base.submodules.mlp, submodules=dataclasses.replace(
            base.submodules.mlp.submodules, linear_fc1=torch.nn.Linear))))
    with pytest.raises(ValueError, match="mlp.linear_fc1 is .*Linear"):
        precision_layer_spec(foreign)


# ----------------------------------------------------------------------------------------------
# Pipeline- and tensor-parallel models: global names, alignment of a real Llama shape


def pp_module_names():
    from megatron_snip.model.quantized.controller import PrecisionController

    return PrecisionController(_gpt(_gpt_config(pp=2))).module_names()


def tp_model_alignment():
    """A TP=2 model: fc1 per rank holds [gate; up] slices of 160 / 2 = 80 rows: fine for
    nvfp4's 16, not for mxfp4's 32; the refused plan must change nothing."""
    from megatron_snip.model.quantized.controller import PrecisionController
    from megatron_snip.precision.plan import PrecisionPlan

    model = _gpt(_gpt_config(tp=2))
    controller = PrecisionController(model)
    controller.apply(PrecisionPlan.uniform("nvfp4"))
    out = {}
    try:
        controller.apply(PrecisionPlan.uniform("mxfp4"))
    except ValueError as e:
        out["error"] = str(e)
    plan = running_plan(controller)
    out["after"] = str(plan.default), {str(p) for p in plan.modules.values()}
    loss = _loss(model, _batch())
    loss.backward()
    out["loss"] = loss.item()
    return out


@pytest.mark.integration
def test_pipeline_stages_use_global_layer_names(results):
    first, second = results["pp_names"]
    assert [n.split(".")[2] for n in first] == ["0"] * 4 + ["1"] * 4
    assert [n.split(".")[2] for n in second] == ["2"] * 4 + ["3"] * 4
    assert second[-1] == "decoder.layers.3.mlp.linear_fc2"


@pytest.mark.integration
def test_tensor_parallel_model_checks_alignment_before_changing(results):
    out = results["tp_model"]
    assert "decoder.layers.0.mlp.linear_fc1: cannot run mxfp4" in out["error"]
    assert "2 slices of 80" in out["error"]
    assert out["after"] == ("bf16", {"nvfp4"}), "a refused plan must leave every module as it was"
    # Same initial weights as the single-rank model (CPU initialisation slices one full weight):
    # the TP=2 nvfp4 model quantizes exactly as TP=1; only fp32 reduction order may differ.
    assert out["loss"] == pytest.approx(results["gpt"]["switch"]["nvfp4"].item(), rel=1e-6)
