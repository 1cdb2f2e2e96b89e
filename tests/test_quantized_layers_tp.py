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

from conftest import free_port

IN, OUT, TOKENS = (8, 4), 64, 48
PRECISIONS = ("nvfp4", "mxfp4", "fp8")
EXACT = {"column": ("y", "dw"), "row": ("dx", "dw")}
SUMMED = {"column": "dx", "row": "y"}  # outputs of an all-reduce over a split reduction dim


def _start(rank: int, world: int, port: int, tp: int = 1, pp: int = 1) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_snip.compat.cpu import enable

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(123)


def _spawn(worker, nprocs: int, out_dir, *args) -> None:
    mp.spawn(worker, args=(nprocs, free_port(), str(out_dir), *args), nprocs=nprocs, join=True)


# ----------------------------------------------------------------------------------------------
# TP=2 vs TP=1 parity of single layers


def _layer_case(kind, precision, tp_group, world):
    """Build one layer of ``kind`` on ``tp_group`` with the shared full weight."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_snip.model.quantized_layers import QuantizedColumnParallelLinear, QuantizedRowParallelLinear
    from megatron_snip.precision.recipes import Precision, RecipeConfig

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                 perform_initialization=False)
    common = dict(config=config, init_method=torch.nn.init.zeros_, bias=False, tp_group=tp_group)
    if kind == "column":
        layer = QuantizedColumnParallelLinear(OUT, 2 * OUT, gather_output=False, **common)
    else:
        layer = QuantizedRowParallelLinear(2 * OUT, OUT, input_is_parallel=True, skip_bias_add=True, **common)
    # Deterministic rounding: stochastic rounding draws per shard, so it is equal in law, not in bits.
    layer.set_recipe(RecipeConfig(fp4_stochastic_rounding=False))
    layer.precision = Precision.uniform(precision)
    return layer


def _run_layer(layer, kind, w_full, x_full, dy_full, rank, world):
    """(y, dx, dw) of one forward/backward, each gathered to the full tensor."""
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
    x = (x_full if kind == "column" else shard(x_full, -1)).clone().requires_grad_()
    y, _ = layer(x)
    y.backward(dy_full if kind == "row" else shard(dy_full, -1))
    if kind == "column":
        return gather(y, -1), x.grad, gather(layer.weight.grad, 0)
    return y, gather(x.grad, -1), gather(layer.weight.grad, 1)


def tp_worker(rank, world, port, out_dir):
    import torch.distributed as dist
    from megatron.core import parallel_state

    _start(rank, world, port, tp=world)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # a TP=1 group per rank
    tp_group = parallel_state.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(0)
    results = {}
    for kind in ("column", "row"):
        in_f, out_f = (OUT, 2 * OUT) if kind == "column" else (2 * OUT, OUT)
        w = torch.randn(out_f, in_f, generator=g) * 0.1
        x = torch.randn(*IN, in_f, generator=g)
        dy = torch.randn(*IN, out_f, generator=g)
        for precision in PRECISIONS:
            tp2 = _run_layer(_layer_case(kind, precision, tp_group, world), kind, w, x, dy, rank, world)
            one = _layer_case(kind, precision, solo, 1)
            tp1 = _run_layer(one, kind, w, x, dy, 0, 1)
            # sum |a_i b_i| of the split-reduction output: the same GEMM on |operands|
            one.weight.grad = None
            magnitude = _run_layer(one, kind, w.abs(), x.abs(), dy.abs(), 0, 1)
            results[kind, precision] = {"tp2": tp2, "tp1": tp1, "magnitude": magnitude}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "tp.pt"))
    # Alignment checks need a TP=2 layer: 2 * OUT / 2 = 64 outputs per rank fit every block,
    # a 48-wide shard does not fit the 32-blocks of mxfp4.
    results = {}
    from megatron.core.model_parallel_config import ModelParallelConfig

    from megatron_snip.model.quantized_layers import QuantizedColumnParallelLinear
    from megatron_snip.precision.recipes import Precision

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True)
    narrow = QuantizedColumnParallelLinear(OUT, 96, config=config, init_method=torch.nn.init.zeros_, bias=False)
    narrow.precision = Precision.uniform("nvfp4")  # 48 per rank: a multiple of 16
    try:
        narrow.precision = Precision.uniform("mxfp4")
    except ValueError as e:
        results["error"] = str(e)
    results["kept"] = str(narrow.precision)
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "align.pt"))


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    _spawn(tp_worker, 2, out)
    return torch.load(out / "tp.pt"), torch.load(out / "align.pt")


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_tp2_matches_tp1(tp_results, kind, precision):
    r = tp_results[0][kind, precision]
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


def test_split_not_on_block_boundaries_is_refused(tp_results):
    align = tp_results[1]
    assert "cannot run mxfp4" in align["error"] and "TP=2" in align["error"] and "48 per rank" in align["error"]
    assert align["kept"] == "nvfp4"


# ----------------------------------------------------------------------------------------------
# A tiny GPT model built from precision_layer_spec


def _gpt_config(tp=1, pp=1):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=160, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, init_method_std=0.02, attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
        use_cpu_initialization=True, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        cuda_graph_scope=[],
    )


def _gpt(config, quantized=True, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_snip.model.quantized_layers import precision_layer_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=precision_layer_spec(spec) if quantized else spec,
                    vocab_size=128, max_sequence_length=32, pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (4, 33), generator=g)
    return tokens[:, :-1], torch.arange(32).expand(4, 32), tokens[:, 1:]


def _loss(model, batch):
    tokens, positions, labels = batch
    return model(tokens, positions, None, labels=labels).float().mean()


MIXED = {"decoder.layers.1.mlp.linear_fc1": "nvfp4", "decoder.layers.1.mlp.linear_fc2": "mxfp4",
         "decoder.layers.1.self_attention.linear_qkv": "fp8", "decoder.layers.2.self_attention.linear_proj": "nvfp4/bf16",
         "decoder.layers.2.mlp.linear_fc1": "fp8/nvfp4", "decoder.layers.2.mlp.linear_fc2": "nvfp4"}


def gpt_worker(rank, world, port, out_dir):
    from megatron_snip.model.precision_control import PrecisionController
    from megatron_snip.precision.plan import PrecisionPlan, module_names
    from megatron_snip.precision.recipes import Precision

    _start(rank, world, port)
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
    out["current"] = controller.current_plan() == PrecisionPlan()
    controller.apply(mixed)
    out["current_mixed"] = controller.current_plan() == mixed
    torch.save(out, os.path.join(out_dir, "gpt.pt"))


@pytest.fixture(scope="module")
def gpt_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt")
    _spawn(gpt_worker, 1, out)
    return torch.load(out / "gpt.pt")


def test_controller_names_every_linear_globally(gpt_results):
    assert gpt_results["names"] == gpt_results["expected_names"]
    assert gpt_results["current"] and gpt_results["current_mixed"]


def test_plan_changes_take_effect_immediately(gpt_results):
    s = gpt_results["switch"]
    assert torch.equal(s["bf16"], s["reference"]), "bf16 must be megatron-core's own forward"
    assert s["changed"] == 16 and set(s["precisions"]) == {"nvfp4"} and s["same_modules"]
    assert not torch.equal(s["nvfp4"], s["bf16"]) and abs(s["nvfp4"] - s["bf16"]) < 0.05
    assert torch.equal(s["back"], s["bf16"])


@pytest.mark.parametrize("plan", ["nvfp4", "mixed"])
def test_quantized_gpt_trains(gpt_results, plan):
    losses, bf16 = gpt_results[plan], gpt_results["bf16"]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0, losses
    # Memorising one batch: 4-bit GEMMs cost some loss, not the learning.
    assert losses[-1] < bf16[-1] + 0.5 * (bf16[0] - bf16[-1]), (losses, bf16)


# ----------------------------------------------------------------------------------------------
# Pipeline- and tensor-parallel models: global names, alignment of a real Llama shape


def parallel_gpt_worker(rank, world, port, out_dir, tp, pp):
    from megatron.core import parallel_state

    from megatron_snip.model.precision_control import PrecisionController
    from megatron_snip.precision.plan import PrecisionPlan

    _start(rank, world, port, tp=tp, pp=pp)
    model = _gpt(_gpt_config(tp, pp), pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage())
    controller = PrecisionController(model)
    out = {"names": controller.module_names()}
    if tp > 1:
        # fc1 per rank: [gate; up] slices of 160 / 2 = 80 rows: fine for nvfp4's 16, not mxfp4's 32.
        controller.apply(PrecisionPlan.uniform("nvfp4"))
        try:
            controller.apply(PrecisionPlan.uniform("mxfp4"))
        except ValueError as e:
            out["error"] = str(e)
        out["after"] = str(controller.current_plan().default), {str(p) for p in controller.current_plan().modules.values()}
        loss = _loss(model, _batch())
        loss.backward()
        out["loss"] = loss.item()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_pipeline_stages_use_global_layer_names(tmp_path):
    _spawn(parallel_gpt_worker, 2, tmp_path, 1, 2)
    first, second = (torch.load(tmp_path / f"rank{r}.pt")["names"] for r in (0, 1))
    assert [n.split(".")[2] for n in first] == ["0"] * 4 + ["1"] * 4
    assert [n.split(".")[2] for n in second] == ["2"] * 4 + ["3"] * 4
    assert second[-1] == "decoder.layers.3.mlp.linear_fc2"


def test_tensor_parallel_model_checks_alignment_before_changing(tmp_path):
    _spawn(parallel_gpt_worker, 2, tmp_path, 2, 1)
    out = torch.load(tmp_path / "rank0.pt")
    assert "decoder.layers.0.mlp.linear_fc1: cannot run mxfp4" in out["error"]
    assert "2 slices of 80" in out["error"]
    assert out["after"] == ("bf16", {"nvfp4"}), "a refused plan must leave every module as it was"
    assert math.isfinite(out["loss"])
