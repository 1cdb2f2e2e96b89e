"""The SNIP probe cycle and ground truth on a tiny megatron-core GPT model.

Two spawns of gloo workers (127.0.0.1), which save their results; the
assertions run here. megatron-core runs on CPU through
megatron_snip.compat.cpu, enabled only inside the workers.

* one process (TP=1, PP=1): ~30 Adam steps on four fixed batches of random
  tokens (memorised, so the model is off its initial point); the probe leaves
  no trace (parameters, gradient buffers, RNG states, precisions,
  quantization states, data iterator); statistics are finite; estimator vs
  ground truth rank correlations.
* two processes: a TP=1 reference (DP=2, both ranks fed the same batches, so
  DP averages are exact) trains and is probed; then the same weights and Adam
  state are loaded into a TP=2 model, a TP=2 model with sequence parallelism,
  the same with full activation recompute, a PP=2 model, a PP=2 model with
  uneven stages (1 + 3 layers), a PP=2 x VPP=2 model (interleaved schedule,
  two chunks per rank) and a DP=2 model with the
  distributed optimizer (also with overlapped grad reduce and param gather),
  and each is probed: the statistics must agree. Not covered: token ids in the probe
  batch that the training never saw, whose embedding rows' Adam response amplifies the
  layouts' rounding into the gains (docs/snip.md, "First-seen tokens: Adam's eps window").

Tolerances of the layout comparison: the layouts compute the same
quantities with fp32 partial sums added in another order (TP all-reduces,
pipeline-stage sums), relative differences ~1e-7 of the tensors (1e-5 allowed);
the Hutchinson curvatures, the gains and the propagated drifts are finite
differences that divide by the noise scale, which amplifies those by
1/output_noise = 20 and 1/param_noise = 1e3, hence 3e-4 and 2e-3 (a draw's
propagated term ``<dX, eX>^2`` relative to its Cauchy-Schwarz bound, as it may
be ~0). Quantization errors may move by more: an input one ulp off can cross a
rounding boundary of the format (and an FP8 per-tensor amax one ulp off
rescales the whole tensor), which moves a handful of elements by a quantum: up
to 2.4e-3 observed (CP2's local update drift, whose attention backward adds in
another order), 5e-3 allowed. Under the distributed optimizer every rank
applies every shard's perturbation (the shards' responses exchanged), so its
draws are TP=1's.
"""

from __future__ import annotations

import copy
import gc
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, in_world_of_one, launch, run_config, running_plan, train_args

VOCAB, SEQ, MBS, MICRO = 128, 32, 4, 2
STEPS = 30
FORMATS = ("fp8", "nvfp4", "mxfp4")
# The probe settings the single-process checks run: the Hutchinson curvature with three draws (the default
# curvature, the empirical Fisher, runs no draws to check), and 32 parameter perturbations: each is one
# squared projection of the propagated drift (a relative spread of sqrt(2 / 32) = 0.25 per module, where the
# default 8 give 0.5), and this model's modules differ by less than 0.5 within a format, so the rank check
# against the ground truth needs the 32 to tell the estimator's bias from the sketch's spread.
PROBES = dict(curvature="hutchinson", hutchinson_probes=3, perturbation_probes=32)
MIXED = {"decoder.layers.1.self_attention.linear_qkv": "fp8", "decoder.layers.1.mlp.linear_fc1": "nvfp4",
         "decoder.layers.2.mlp.linear_fc2": "mxfp4", "decoder.layers.3.self_attention.linear_proj": "nvfp4/bf16"}


# ----------------------------------------------------------------------------------------------
# Shared worker helpers (run inside spawned processes)


def _layout(tp=1, pp=1, vpp=None, cp=1):
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp)


def _start(rank, world, port):
    import torch.distributed as dist

    from megatron_snip.compat.cpu import enable

    torch.set_num_threads(1)
    enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def _fused_norm_layer_spec():
    """The local layer spec laid out like megatron-core's Transformer Engine spec: no separate norms,
    linear_qkv and linear_fc1 fuse the norm before their GEMM (TE's LayerNormLinear), every linear
    carries ``te_quant_params``, so the controller drives it through the te backend's adapter and the
    probes measure it as they measure TE's modules. Transformer Engine cannot be installed here; these
    are megatron-core's own local linears, and they ignore ``te_quant_params`` (the probes run all
    modules in bf16)."""
    import dataclasses

    import torch.nn.functional as F
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    from megatron_snip.model import llama

    class _TEInterface:
        def _te_interface(self, mode):
            self.te_quant_params = None
            self.parallel_mode = mode
            self._tp_group = self.tp_group

    class FusedNormColumnParallelLinear(ColumnParallelLinear, _TEInterface):
        def __init__(self, input_size, output_size, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self._te_interface("column")
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_weight.sequence_parallel = config.sequence_parallel

        def forward(self, x):
            # torch's own RMSNorm, independent of the adapter's fused_norm_output
            normed = F.rms_norm(x, x.shape[-1:], self.layer_norm_weight, self.config.layernorm_epsilon)
            return super().forward(normed)

    class TERowInterfaceLinear(RowParallelLinear, _TEInterface):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._te_interface("row")

    base = llama.layer_spec("local").submodules
    attention, mlp = base.self_attention, base.mlp
    submodules = dataclasses.replace(
        base, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp,
        self_attention=dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, linear_qkv=FusedNormColumnParallelLinear, linear_proj=TERowInterfaceLinear)),
        mlp=dataclasses.replace(mlp, submodules=dataclasses.replace(
            mlp.submodules, linear_fc1=FusedNormColumnParallelLinear, linear_fc2=TERowInterfaceLinear)))
    return dataclasses.replace(llama.layer_spec("local"), submodules=submodules)


def _build(distributed_optimizer=False, stochastic_rounding=True, sequence_parallel=False, vpp=None,
           recompute=False, overlap=False, fused_norm=False, first_stage_layers=None):
    """A 4-layer hidden-64 Llama in the current parallel layout, built, wrapped in megatron DDP and given Adam
    by the trainer's own builders (with ``vpp``, one chunk per virtual pipeline stage; ``fused_norm``: with
    :func:`_fused_norm_layer_spec`; ``first_stage_layers``: uneven stages, the first holding that many)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_snip.model import llama
    from megatron_snip.model.llama import build_model, transformer_config
    from megatron_snip.model.quantized.controller import PrecisionController
    from megatron_snip.numerics.recipes import RecipeConfig
    from megatron_snip.training.setup import build_optimizer, wrap_ddp

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    dp = dist.get_world_size() // (tp * pp * cp)
    # Vocabulary rows padded to a multiple of 64 x TP: 128 at TP 1 and 2, so every layout has the same model.
    flags = ["--ffn-hidden-size", "160", "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
             "--make-vocab-size-divisible-by", "64", "--tensor-model-parallel-size", str(tp),
             "--pipeline-model-parallel-size", str(pp), "--context-parallel-size", str(cp),
             "--micro-batch-size", str(MBS),
             "--global-batch-size", str(MBS * MICRO * dp), "--lr", "3e-3", "--weight-decay", "0.01"]
    flags += ["--use-distributed-optimizer"] if distributed_optimizer else []
    flags += ["--sequence-parallel"] if sequence_parallel else []
    flags += ["--virtual-pipeline-model-parallel-size", str(vpp)] if vpp else []
    flags += ["--decoder-first-pipeline-num-layers", str(first_stage_layers)] if first_stage_layers else []
    flags += ["--recompute-granularity", "full", "--recompute-method", "uniform"] if recompute else []
    flags += ["--overlap-grad-reduce", "--overlap-param-gather"] if overlap else []
    run = run_config(*flags, world_size=dist.get_world_size())
    torch.manual_seed(123)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    config = transformer_config(run.model, run.parallel)
    if fused_norm and not hasattr(llama.layer_spec, "fused_norm"):  # this worker process only
        spec = _fused_norm_layer_spec()
        llama.layer_spec = lambda *_: spec  # (transformer_impl, attention_backend)
        llama.layer_spec.fused_norm = True
    chunks = wrap_ddp(run.parallel, config, build_model(run.model, run.parallel, config, VOCAB))
    optimizer = build_optimizer(run.training, run.model, run.parallel, chunks)
    controller = PrecisionController(chunks, seed=1)
    # Stochastic rounding draws per rank: equal in law across layouts, not in bits.
    controller.set_recipe(RecipeConfig(fp4_stochastic_rounding=stochastic_rounding))
    return chunks, optimizer, controller


def _batches(n, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        micro = []
        for _ in range(MICRO):
            t = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
            micro.append({"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
                          "loss_mask": torch.ones(MBS, SEQ),
                          "position_ids": torch.arange(SEQ).expand(MBS, SEQ).contiguous()})
        out.append(micro)
    return out


def _train(chunks, optimizer, batches, steps):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_snip.model.step import forward_step

    schedule = get_forward_backward_func()
    for i in range(steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        schedule(forward_step_func=forward_step, data_iterator=iter(batches[i % len(batches)]), model=chunks,
                 num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS, forward_only=False)
        optimizer.step()


def _probe(chunks, optimizer, controller, batch, **config):
    from megatron_snip.snip.probes import ProbeConfig, gather_across_pipeline, run_probe_cycle

    stats = run_probe_cycle(chunks, optimizer, controller, iter(batch), num_microbatches=MICRO, seq_length=SEQ,
                            micro_batch_size=MBS, config=ProbeConfig(**config), iteration=STEPS)
    return gather_across_pipeline(stats)


# ----------------------------------------------------------------------------------------------
# One process: no side effects, finite statistics, estimator vs ground truth


def single_worker(rank, world, port, out_dir):
    import time

    from megatron_snip.numerics.linear import LinearQuantizers
    from megatron_snip.numerics.recipes import BF16, Precision
    from megatron_snip.precision.plan import PrecisionPlan
    from megatron_snip.snip.estimators import divergences, local_error_baselines
    from megatron_snip.snip.probes import ProbeConfig, run_probe_cycle
    from snip_lab.ground_truth import backward_ground_truth, forward_ground_truth, group_drift
    from snip_lab.ranks import rank_correlations

    _start(rank, world, port)
    _layout()
    chunks, optimizer, controller = _build()
    batches = _batches(4, seed=0)
    _train(chunks, optimizer, batches, STEPS)
    out = {}

    # A training state worth preserving: a mixed plan whose quantization states have drawn random
    # numbers, and the gradient buffers of one more step.
    controller.apply(PrecisionPlan({k: Precision.parse(v) for k, v in MIXED.items()}))
    _train(chunks, optimizer, batches, 1)
    before = _snapshot(chunks, controller)
    out["state_was_live"] = (any(g.abs().max().item() > 0 for g in before["grads"])
                             and all(r is not None for r in before["grad_references"]))
    data = iter([*batches[0], batches[1][0]])
    graphs_before = _live_autograd_outputs()
    t0 = time.perf_counter()
    stats = run_probe_cycle(chunks, optimizer, controller, data, num_microbatches=MICRO, seq_length=SEQ,
                            micro_batch_size=MBS, config=ProbeConfig(**PROBES, restore_grads=True), iteration=STEPS)
    out["probe_seconds"] = time.perf_counter() - t0
    out["graphs_left"] = _live_autograd_outputs() - graphs_before
    out["left_in_iterator"] = next(data)["tokens"].equal(batches[1][0]["tokens"])
    after = _snapshot(chunks, controller)
    out["unchanged"] = {k: _same(before[k], after[k]) for k in before}
    # The same cycle with the empirical-Fisher curvature: no Hutchinson passes, the rest the same.
    passes = {"n": 0}
    first = next(iter(controller.modules().values()))
    handle = first.register_forward_pre_hook(lambda *_: passes.__setitem__("n", passes["n"] + 1))
    counted = {}
    for curvature in ("hutchinson", "fisher"):
        passes["n"] = 0
        counted[curvature] = run_probe_cycle(
            chunks, optimizer, controller, iter(batches[0]), num_microbatches=MICRO, seq_length=SEQ,
            micro_batch_size=MBS, config=ProbeConfig(**{**PROBES, "curvature": curvature}, restore_grads=True),
            iteration=STEPS)
        out[f"forward_calls_{curvature}"] = passes["n"]
    handle.remove()
    out["fisher_pair"] = (counted["hutchinson"].to_dict(), counted["fisher"].to_dict())
    # The same cycle with the gains leaving out the embedding's drift, and every parameter below layer 1's.
    out["gain_excludes"] = {excludes: run_probe_cycle(
        chunks, optimizer, controller, iter(batches[0]), num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=MBS,
        config=ProbeConfig(**PROBES, gain_excludes=excludes, restore_grads=True), iteration=STEPS).to_dict()
        for excludes in (("embedding",), ("embedding", "decoder.layers.0."))}
    try:
        run_probe_cycle(chunks, optimizer, controller, iter(batches[0]), num_microbatches=MICRO, seq_length=SEQ,
                        micro_batch_size=MBS, config=ProbeConfig(**PROBES, gain_excludes=("embeding",),
                                                                 restore_grads=True))
    except ValueError as e:
        out["gain_excludes_error"] = str(e)
    run_probe_cycle(chunks, optimizer, controller, iter(batches[0]), num_microbatches=MICRO, seq_length=SEQ,
                    micro_batch_size=MBS, config=ProbeConfig(hutchinson_probes=1, perturbation_probes=1))
    out["grads_zeroed"] = all(b.grad_data.abs().max().item() == 0 for b in chunks[0].buffers)
    out["params_unchanged_default"] = _same(before["params"], _snapshot(chunks, controller)["params"])
    out["stats"] = stats.to_dict()
    # One operand error recomputed outside the probe: fc1's weight in nvfp4, counted once per cycle.
    from megatron_snip.numerics.linear import LinearQuantization, QuantState, quantize_operand

    fc1 = controller.modules()["decoder.layers.1.mlp.linear_fc1"]
    w = fc1.weight.detach().float()
    quant = LinearQuantization(Precision.uniform("nvfp4"), fc1.recipe, QuantState())
    out["fc1_w_nvfp4_error_sq"] = (quantize_operand(w, quant.quantizer("fprop", "w"), "w", quant) - w).square().sum(
        dtype=torch.float64).item()
    # FP8 recipes as candidates of their own: the probes price each with its own quantizers, whatever the run's
    # recipe; the reference is fp8 under that recipe as the run's --fp8-recipe.
    from dataclasses import replace

    recipes = ("tensorwise", "rowwise", "blockwise")
    by_recipe = run_probe_cycle(chunks, optimizer, controller, iter(batches[0]), num_microbatches=MICRO,
                                seq_length=SEQ, micro_batch_size=MBS, iteration=STEPS,
                                config=ProbeConfig(formats=tuple(f"fp8:{r}" for r in recipes), curvature="fisher",
                                                   perturbation_probes=1, restore_grads=True))
    module = by_recipe.modules["decoder.layers.1.mlp.linear_fc1"]
    out["fc1_w_fp8_recipes"] = {r: module.errors[f"fp8:{r}"].operand_sq["w"] for r in recipes}
    out["fc1_output_fp8_recipes"] = {r: module.errors[f"fp8:{r}"].output_sq for r in recipes}
    reference = {}
    for r in recipes:
        quant = LinearQuantization(Precision.uniform("fp8"), replace(fc1.recipe, fp8_recipe=r), QuantState())
        reference[r] = (quantize_operand(w, quant.quantizer("fprop", "w"), "w", quant) - w).square().sum(
            dtype=torch.float64).item()
    out["fc1_w_fp8_reference"] = reference

    # Estimator vs ground truth: every module in every format, on the probe batch.
    controller.apply(PrecisionPlan())
    d = divergences(stats)
    fwd_est = {n: {f: v.forward for f, v in row.items()} for n, row in d.items()}
    bwd_est = {n: {f: v.backward for f, v in row.items()} for n, row in d.items()}
    absolute, relative = local_error_baselines(stats)
    t0 = time.perf_counter()
    fwd = forward_ground_truth(chunks, controller, [batches[0]], FORMATS, seq_length=SEQ, micro_batch_size=MBS)
    bwd = backward_ground_truth(chunks, optimizer, controller, [batches[0]], FORMATS, seq_length=SEQ,
                                micro_batch_size=MBS, seeds=(0, 1))
    out["ground_truth_seconds"] = time.perf_counter() - t0
    # A group of one module on one batch is the per-module truth (the same rounding seed), split in two;
    # the same batch twice repeats its drift exactly; a whole type over two batches drifts partly alike.
    fc2 = "decoder.layers.2.mlp.linear_fc2"
    one = backward_ground_truth(chunks, optimizer, controller, [batches[0]], ["mxfp4"], seq_length=SEQ,
                                micro_batch_size=MBS)[fc2]["mxfp4"]
    every_fc2 = [n for n in controller.modules() if n.endswith("linear_fc2")]
    out["group_drift"] = {
        "truth": one,
        "one": group_drift(chunks, optimizer, controller, [batches[0], batches[0]], {"fc2": [fc2]},
                           Precision("bf16", "mxfp4"), seq_length=SEQ, micro_batch_size=MBS)["fc2"],
        **{side: group_drift(chunks, optimizer, controller, batches[:2], {"fc2": every_fc2}, precision,
                             seq_length=SEQ, micro_batch_size=MBS)["fc2"]
           for side, precision in (("bwd", Precision("bf16", "mxfp4")), ("fwd", Precision("mxfp4", "bf16")))},
        "dgrad_w": group_drift(chunks, optimizer, controller, batches[:2], {"fc2": [fc2]}, Precision("bf16", "mxfp4"),
                               seq_length=SEQ, micro_batch_size=MBS, operands={("dgrad", "w")})["fc2"]}
    out["quantizers_restored"] = (controller.modules()[fc2]._quantizers
                                  == LinearQuantizers.resolve(BF16, controller.modules()[fc2].recipe))
    out["params_unchanged_by_group_drift"] = _same(before["params"], _snapshot(chunks, controller)["params"])
    out["rho"] = {
        "forward vs loss change": rank_correlations(fwd_est, fwd.loss_change),
        "forward vs loss change beyond the linear term": rank_correlations(fwd_est, fwd.second_order),
        "|E|^2 vs loss change beyond the linear term": rank_correlations(absolute, fwd.second_order),
        "|E|^2/|Y|^2 vs loss change beyond the linear term": rank_correlations(relative, fwd.second_order),
        "backward vs update drift": rank_correlations(bwd_est, bwd),
        "|E|^2 vs update drift": rank_correlations(absolute, bwd),
        "|E|^2/|Y|^2 vs update drift": rank_correlations(relative, bwd),
    }
    first_from_probe = {n: {f: e.first_order / stats.loss for f, e in m.errors.items()}
                        for n, m in stats.modules.items()}
    out["first_order"] = (first_from_probe, fwd.first_order)
    out["scale"] = {  # median estimate / truth
        "forward": _median_ratio(fwd_est, fwd.second_order), "backward": _median_ratio(bwd_est, bwd)}
    torch.save(out, os.path.join(out_dir, "single.pt"))


def _live_autograd_outputs() -> int:
    """Live tensors that carry an autograd graph (after a full collection). A measurement kept
    with its graph holds that graph's saved activations: on an H200 the probe cycle's sums of
    squares kept fp32 copies of every module output, 60 GB at the TinyLlama-1.1B shape, for good
    (the graph and the backward hooks formed a cycle the collector cannot free)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def _snapshot(chunks, controller):
    from megatron.core import tensor_parallel

    modules = controller.modules()
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {
        "params": {n: p.detach().clone() for n, p in chunks[0].named_parameters()},
        "grads": [b.grad_data.clone() for b in chunks[0].buffers],
        "cpu_rng": torch.get_rng_state(),
        "tracker_rng": {k: v.clone() for k, v in tracker.items()},
        "plan": running_plan(controller).to_dict(),
        "quant_state_objects": [id(m.quant_state) for m in modules.values()],
        "rounding_rng": [m.quant_state.generator(torch.device("cpu")).get_state() for m in modules.values()],
        "grad_references": [None if p.grad is None else id(p.grad) for p in chunks[0].parameters()],
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _median_ratio(estimate, truth):
    ratios = sorted(estimate[m][f] / truth[m][f] for m in truth for f in truth[m] if truth[m][f] > 0)
    return ratios[len(ratios) // 2]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("snip_single")
    mp.spawn(single_worker, args=(1, free_port(), str(out)), nprocs=1, join=True)
    return torch.load(out / "single.pt", weights_only=False)


@pytest.mark.integration
def test_probe_leaves_no_trace(single):
    assert single["state_was_live"], "the check needs gradients and param.grad references to preserve"
    assert single["unchanged"] == {k: True for k in single["unchanged"]}, single["unchanged"]
    assert single["left_in_iterator"], "the probe must read exactly num_microbatches micro-batches"
    assert single["graphs_left"] == 0, f"{single['graphs_left']} tensors still hold the probe's autograd graphs"
    assert single["grads_zeroed"] and single["params_unchanged_default"]


@pytest.mark.integration
def test_fisher_curvature_skips_the_hutchinson_passes_and_changes_nothing_else(single):
    """``--snip-curvature fisher``: the cycle runs no Hutchinson pass (per micro-batch: the gradient pass, the
    clean forward + backward, one forward per perturbation draw; and one forward + backward per Hutchinson
    draw), each module's curvature is ``N ||dY||^2`` of the clean pass, and every other statistic is the
    Hutchinson cycle's bit for bit (the same state, batch and noise)."""
    from megatron_snip.snip.estimators import fisher_trace

    micro, k = MICRO, PROBES["hutchinson_probes"]
    assert single["forward_calls_hutchinson"] == (2 + PROBES["perturbation_probes"] + k) * micro
    assert single["forward_calls_fisher"] == (2 + PROBES["perturbation_probes"]) * micro
    hutchinson, fisher = copy.deepcopy(single["fisher_pair"])  # the fixture is shared: pop from copies
    assert fisher["settings"].pop("curvature") == "fisher"
    assert hutchinson["settings"].pop("curvature") == "hutchinson"
    for name, m in fisher["modules"].items():
        h = hutchinson["modules"][name]
        assert m.pop("curvature_probes") == [] and len(h.pop("curvature_probes")) == k
        tokens = MICRO * MBS * SEQ
        assert m["output_numel"] == tokens * m["out_features"]
        assert m.pop("curvature") == fisher_trace(m["output_grad_sq"], m["output_numel"], m["out_features"]) > 0
        h.pop("curvature")
        assert m == h, name
    assert {k: v for k, v in fisher.items() if k != "modules"} == {k: v for k, v in hutchinson.items()
                                                                   if k != "modules"}


@pytest.mark.integration
def test_gain_excludes_leave_those_parameters_out_of_the_gains_and_change_nothing_else(single):
    """``--snip-gain-exclude``: with the embedding and layer 0 left unperturbed nothing below layer 0's
    modules moves, so their gains are exactly 0 and layer 1's are not; leaving out the embedding alone
    changes every module's gain (every input depends on it) and no other statistic, the perturbation
    scale included; a pattern that names no parameter is refused, naming the flag."""
    default = copy.deepcopy(single["fisher_pair"][0])
    only_above_0 = single["gain_excludes"][("embedding", "decoder.layers.0.")]
    for name, m in only_above_0["modules"].items():
        if m["layer"] == 0:
            assert m["gain"] == 0 and set(m["gain_probes"]) == {0.0}, name
        else:
            assert m["gain"] > 0, name
    no_embedding = copy.deepcopy(single["gain_excludes"][("embedding",)])
    assert tuple(no_embedding["settings"].pop("gain_excludes")) == ("embedding",)
    assert tuple(default["settings"].pop("gain_excludes")) == ()
    for name, m in no_embedding["modules"].items():
        d = default["modules"][name]
        assert m.pop("gain") != d.pop("gain"), name
        m.pop("gain_probes"), d.pop("gain_probes")
        for fmt, errors in m["errors"].items():  # the propagated drift, measured by the same perturbation
            assert errors.pop("propagated") != d["errors"][fmt].pop("propagated"), (name, fmt)
            errors.pop("propagated_probes"), d["errors"][fmt].pop("propagated_probes")
        assert m == d, name
    assert {k: v for k, v in no_embedding.items() if k != "modules"} == {k: v for k, v in default.items()
                                                                          if k != "modules"}
    assert "--snip-gain-exclude embeding: names no parameter" in single["gain_excludes_error"]


@pytest.mark.integration
def test_statistics_are_finite_and_complete(single):
    from megatron_snip.precision.plan import module_names
    from megatron_snip.snip.statistics import ProbeStatistics

    def numbers(value):
        if isinstance(value, dict | list):
            for v in value.values() if isinstance(value, dict) else value:
                yield from numbers(v)
        elif isinstance(value, float | int) and not isinstance(value, bool):
            yield value

    stats = ProbeStatistics.from_dict(single["stats"])
    assert all(math.isfinite(v) for v in numbers(single["stats"]))
    assert stats.loss > 0 and stats.update_sq > 0
    assert list(stats.modules) == module_names(4)
    for m in stats.modules.values():
        assert set(m.errors) == set(FORMATS) and not m.unsupported
        draws = PROBES["perturbation_probes"]
        assert m.curvature > 0 and m.gain > 0
        assert len(m.curvature_probes) == PROBES["hutchinson_probes"] and len(m.gain_probes) == draws
        for e in m.errors.values():
            assert e.propagated > 0 and len(e.propagated_probes) == draws
            assert e.propagated == pytest.approx(sum(e.propagated_probes) / draws, rel=1e-12)
        assert m.output_numel == MICRO * MBS * SEQ * m.out_features
        # fp8 errors are well below fp4's in every GEMM
        for field in ("output_sq", "input_grad_sq", "update_sq"):
            assert getattr(m.errors["fp8"], field) < getattr(m.errors["nvfp4"], field)
        # the operands' own errors (the paper's baselines): relative to the operand, fp8 ~1e-3, fp4 ~1e-2
        norms = {"x": m.input_sq, "w": m.weight_sq, "dy": m.output_grad_sq}
        for operand, norm in norms.items():
            fp8, fp4 = (m.errors[f].operand_sq[operand] / norm for f in ("fp8", "nvfp4"))
            assert 1e-5 < fp8 < fp4 < 0.1, (m.name, operand, fp8, fp4)
    assert stats.modules["decoder.layers.1.mlp.linear_fc1"].errors["nvfp4"].operand_sq["w"] == pytest.approx(
        single["fc1_w_nvfp4_error_sq"], rel=1e-6)  # the probe's fp32 dot product against an fp64 sum


@pytest.mark.integration
def test_each_fp8_recipe_is_measured_with_its_own_quantizers(single):
    """fp8:tensorwise / rowwise / blockwise as candidates: each weight error is its recipe's reference quantizer's
    (under a tensorwise run), and tensorwise's errors differ from the power-of-two-scaled recipes', so the ILP sees
    them apart. (Rowwise and blockwise round alike here: a power-of-two scale changes no element's rounding but
    for subnormals, and at this width a 1x128 block is a whole row.)"""
    probe, reference = single["fc1_w_fp8_recipes"], single["fc1_w_fp8_reference"]
    for recipe, value in probe.items():
        assert value == pytest.approx(reference[recipe], rel=1e-6), recipe  # fp32 dot product vs fp64 sum
    for stats in (probe, single["fc1_output_fp8_recipes"]):
        assert stats["tensorwise"] != pytest.approx(stats["rowwise"], rel=1e-6), stats


@pytest.mark.integration
def test_first_order_term_of_probe_and_ground_truth_agree(single):
    """Two independent computations of <dY, E_f>: the probe's clean pass and the ground truth's real runs."""
    probe, truth = single["first_order"]
    for m in truth:
        for f in truth[m]:
            assert probe[m][f] == pytest.approx(truth[m][f], rel=1e-4, abs=1e-9)


@pytest.mark.integration
def test_group_drift_splits_the_per_module_truth_and_measures_persistence(single):
    g = single["group_drift"]
    one = g["one"]
    # Own weights + the others = the whole model's drift that backward_ground_truth measures.
    assert one.own + one.other == pytest.approx(g["truth"], rel=1e-9)
    assert one.own > 0 and one.other > 0
    # the same batch twice: the same drift, on each part
    for p in (one.persistence, one.own_persistence, one.other_persistence):
        assert p == pytest.approx(1.0, abs=1e-9)
    for side in ("bwd", "fwd"):
        assert g[side].own > 0 and g[side].other > 0
        for p in (g[side].persistence, g[side].own_persistence, g[side].other_persistence):
            assert -1 < p < 1 and p != pytest.approx(1.0, abs=1e-3)
    # dgrad's quantized weight alone moves the gradients below the module, not its own (its wgrad's
    # operands run in bf16: the own drift is that rounding, not MXFP4's)
    w_only = g["dgrad_w"]
    assert w_only.other > 0 and w_only.own < 1e-2 * w_only.other
    assert single["params_unchanged_by_group_drift"] and single["quantizers_restored"]


@pytest.mark.integration
def test_estimators_rank_like_the_ground_truth(single):
    rho = single["rho"]
    print(f"\nclean loss {single['stats']['loss']:.3f}; probe {single['probe_seconds']:.1f} s, ground truth "
          f"{single['ground_truth_seconds']:.1f} s; median estimate/truth: {single['scale']}")
    for name, values in rho.items():
        print(f"  Spearman {name}: " + ", ".join(f"{k} {v:+.3f}" for k, v in values.items()))
    assert rho["forward vs loss change"]["all"] > 0
    assert rho["backward vs update drift"]["all"] > 0.9
    for fmt in FORMATS:
        assert rho["forward vs loss change beyond the linear term"][fmt] > 0.7
        assert rho["backward vs update drift"][fmt] > 0.7
    # The estimators beat the local-error baselines on what they estimate.
    assert (rho["forward vs loss change beyond the linear term"]["all"]
            > rho["|E|^2/|Y|^2 vs loss change beyond the linear term"]["all"])
    assert rho["backward vs update drift"]["all"] > rho["|E|^2/|Y|^2 vs update drift"]["all"]


# ----------------------------------------------------------------------------------------------
# Two processes: TP=2, PP=2 and the distributed optimizer against TP=1, from the same state


# name -> (parallel sizes, _build options): every layout and feature the probes must not notice.
LAYOUTS = {
    "tp2": (dict(tp=2), {}),
    "tp2sp": (dict(tp=2), dict(sequence_parallel=True)),
    "tp2sp_full_recompute": (dict(tp=2), dict(sequence_parallel=True, recompute=True)),
    "pp2": (dict(pp=2), {}),
    "pp2vpp2": (dict(pp=2, vpp=2), {}),
    "pp2_uneven": (dict(pp=2), dict(first_stage_layers=1)),  # layer 0 on stage 0, layers 1-3 on stage 1
    "distributed_optimizer": ({}, dict(distributed_optimizer=True)),
    "distributed_optimizer_overlap": ({}, dict(distributed_optimizer=True, overlap=True)),
    # Each rank holds two chunks of every sequence; with the distributed optimizer, half of the Adam state.
    "cp2": (dict(cp=2), {}),
    "cp2_distributed_optimizer": (dict(cp=2), dict(distributed_optimizer=True)),
    # The te backend's measurement path: modules seen through its adapter, the GEMM's input after a
    # fused norm (last: the fused spec stays in the worker once built).
    "te_layout_tp1": ({}, dict(fused_norm=True)),
    "te_layout_tp2sp": (dict(tp=2), dict(fused_norm=True, sequence_parallel=True)),
    "te_layout_pp2vpp2": (dict(pp=2, vpp=2), dict(fused_norm=True)),
}


def parallel_worker(rank, world, port, out_dir):
    from megatron_snip.snip.adam_view import AdamView

    _start(rank, world, port)
    batches = _batches(4, seed=0)
    results = {}
    _layout()  # TP=1, DP=2; both ranks see the same batches
    chunks, optimizer, controller = _build(stochastic_rounding=False)
    _train(chunks, optimizer, batches, 10)
    # One noise draw per estimate suffices to compare layouts (the draws are layout-invariant).
    results["tp1"] = _probe(chunks, optimizer, controller, batches[0], curvature="hutchinson", hutchinson_probes=1,
                            perturbation_probes=1).to_dict()
    reference = {s.name: {"param": s.param.detach().clone(), "exp_avg": s.state["exp_avg"].clone(),
                          "exp_avg_sq": s.state["exp_avg_sq"].clone(), "step": s.step}
                 for s in AdamView(optimizer, chunks).slices.values()}
    for name, (layout, build) in LAYOUTS.items():
        _layout(**layout)
        chunks, optimizer, controller = _build(stochastic_rounding=False, vpp=layout.get("vpp"), **build)
        results[f"{name}.sequence_parallel"] = {m.sequence_parallel for m in controller.modules().values()}
        results[f"{name}.interface"] = {type(m).__name__ for m in controller.modules().values()}
        _load(chunks, optimizer, reference)
        results[name] = _probe(chunks, optimizer, controller, batches[0], curvature="hutchinson",
                               hutchinson_probes=1, perturbation_probes=1).to_dict()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "parallel.pt"))


def _load(chunks, optimizer, reference):
    """This layout's share of the reference (TP=1) weights and Adam state."""
    from megatron_snip.model.parameter_names import global_parameter_names
    from megatron_snip.snip.adam_view import AdamView
    from megatron_snip.snip.noise import param_global_index as index

    for chunk in chunks:  # one step on zero gradients creates the Adam state, overwritten below
        chunk.zero_grad_buffer()
    optimizer.step()
    with torch.no_grad():
        for param, name in global_parameter_names(chunks).items():
            param.copy_(reference[name]["param"].view(-1)[index(param)].view_as(param))
        for s in AdamView(optimizer, chunks).slices.values():
            for key in ("exp_avg", "exp_avg_sq"):
                s.state[key].view(-1).copy_(reference[s.name][key].view(-1)[index(s.param, s.start, s.end)])
            s.state["step"].fill_(reference[s.name]["step"])


@pytest.fixture(scope="module")
def parallel(tmp_path_factory):
    out = tmp_path_factory.mktemp("snip_parallel")
    mp.spawn(parallel_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return torch.load(out / "parallel.pt", weights_only=False)


def _differences(a: dict, b: dict) -> dict[str, float]:
    """Largest relative difference per statistic over modules (and formats both measured)."""
    out = {key: abs(a[key] - b[key]) / b[key] for key in ("loss", "update_sq")}
    for name, m in b["modules"].items():
        other = a["modules"][name]
        for key, v in m.items():
            if key in ("errors", "curvature_probes", "gain_probes", "unsupported") or not isinstance(v, float):
                continue
            out[key] = max(out.get(key, 0.0), abs(other[key] - v) / abs(v))
        for fmt, errors in m["errors"].items():
            if fmt in other["errors"]:
                for operand, v in errors["operand_sq"].items():
                    diff = abs(other["errors"][fmt]["operand_sq"][operand] - v) / v
                    out[f"errors.operand_sq.{operand}"] = max(out.get(f"errors.operand_sq.{operand}", 0.0), diff)
                for key, v in errors.items():
                    if key in ("operand_sq", "propagated_probes") or v is None:  # None: rounds to nearest
                        assert v == other["errors"][fmt][key] or key in ("operand_sq", "propagated_probes")
                        continue
                    # <dY, E> may be ~0: relative to its Cauchy-Schwarz bound ||dY|| ||E||; so may one draw's
                    # <dX, eX>: its square relative to the bound ||dX||^2 ||eX||^2 (the gain's draw times ||eX||^2)
                    scale = (math.sqrt(errors["output_sq"] * m["output_grad_sq"]) if key == "first_order"
                             else m["gain"] * errors["input_grad_sq"] if key == "propagated" else abs(v))
                    diff = abs(other["errors"][fmt][key] - v) / scale
                    out[f"errors.{key}"] = max(out.get(f"errors.{key}", 0.0), diff)
    return out


TOLERANCE = {"curvature": 3e-4, "gain": 2e-3, "errors.propagated": 2e-3, "errors.output_sq": 5e-3,
             "errors.first_order": 5e-3, "errors.input_grad_sq": 5e-3, "errors.update_sq": 5e-3,
             "errors.operand_sq.x": 5e-3, "errors.operand_sq.w": 5e-3, "errors.operand_sq.dy": 5e-3}


@pytest.mark.integration
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_statistics_do_not_depend_on_the_parallel_layout(parallel, layout):
    diff = _differences(parallel[layout], parallel["tp1"])
    print(f"\n{layout}: largest relative differences " + ", ".join(f"{k} {v:.1e}" for k, v in diff.items()))
    for key, value in diff.items():
        assert value <= TOLERANCE.get(key, 1e-5), (key, value)
    # tp2sp: the linears' inputs (column-parallel) and outputs (row-parallel) are sequence slices
    assert parallel[f"{layout}.sequence_parallel"] == {LAYOUTS[layout][1].get("sequence_parallel", False)}
    if LAYOUTS[layout][1].get("fused_norm"):  # measured through the te backend's adapter, which has no MXFP4
        assert parallel[f"{layout}.interface"] == {"TELinearPrecision"}
        for m in parallel[layout]["modules"].values():
            assert "no MXFP4 recipe" in m["unsupported"]["mxfp4"]
    else:
        assert parallel[f"{layout}.interface"] <= {"QuantizedColumnParallelLinear", "QuantizedRowParallelLinear"}


def _plan(stats: dict, modules, per_stage=False):
    """The plan ``stats`` give ``modules`` with every candidate, half the linear FLOPs in FP4 (per stage with
    ``per_stage``), the GEMM time priced as research mode prices it."""
    from megatron_snip.numerics.recipes import RecipeConfig
    from megatron_snip.precision.gemm_speed import peak_speed_model
    from megatron_snip.snip.estimators import cost_tables
    from megatron_snip.snip.planner import PlannerConfig, build_problem, solve_plan
    from megatron_snip.snip.statistics import ProbeStatistics

    formats = ("bf16", *FORMATS)
    config = PlannerConfig(formats=formats, fp4_target=0.5, solver="highs", per_stage=per_stage,
                           speed=peak_speed_model("blackwell").precision_speeds(RecipeConfig(), formats))
    costs = cost_tables(ProbeStatistics.from_dict(stats), formats=formats)
    return solve_plan(build_problem(modules, costs, config), config)


@pytest.mark.integration
def test_context_parallel_statistics_plan_as_cp1s(parallel):
    """The plan the CP2 statistics give is the CP=1 statistics' plan."""
    from megatron_snip.snip.ilp import LinearModule

    modules = [LinearModule.from_shape(name, m["layer"], MBS * MICRO * SEQ, m["in_features"], m["out_features"])
               for name, m in parallel["tp1"]["modules"].items()]
    # The reference's two data-parallel ranks saw the same batch: one replica's errors, where the local update
    # drift's 1/D takes independent batches (estimators.module_divergences). As one replica, as CP2 is.
    reference = _plan({**parallel["tp1"], "data_parallel_size": 1}, modules)[0]
    assert len({str(p) for p in reference.modules.values()}) > 1  # a real choice among modules
    for layout in ("cp2", "cp2_distributed_optimizer"):
        assert parallel[layout]["data_parallel_size"] == 1
        assert _plan(parallel[layout], modules)[0] == reference, layout


@pytest.mark.integration
def test_uneven_stages_measure_on_their_stages_and_plan_as_tp1_under_per_stage_budgets(parallel):
    """PP2 with 1 + 3 layers: each module is measured on the stage the layout places it, and under per-stage
    budgets over those stages (stage 0 is layer 0 alone) its statistics give the plan TP=1's statistics give,
    each stage at half its own FLOPs in FP4."""
    from megatron_snip.precision.flops import LlamaLinearDims
    from megatron_snip.precision.pipeline_layout import PipelineLayout
    from megatron_snip.snip.planner import linear_modules

    layout = PipelineLayout(4, 2, first_stage_layers=1)
    uneven = parallel["pp2_uneven"]
    assert uneven["stages"] == [0, 1]
    assert {m["layer"]: m["stage"] for m in uneven["modules"].values()} == {0: 0, 1: 1, 2: 1, 3: 1}
    dims = LlamaLinearDims(num_layers=4, hidden_size=64, ffn_hidden_size=160, kv_channels=16, num_query_groups=2)
    modules = linear_modules(dims, MBS * MICRO * SEQ, layout)
    assert all(dims.in_out(name.split(".", 3)[3]) == (m["in_features"], m["out_features"])
               for name, m in parallel["tp1"]["modules"].items())
    assert {m.name: (m.layer, m.stage) for m in modules} == {
        n: (s["layer"], s["stage"]) for n, s in uneven["modules"].items()}
    reference, _ = _plan(parallel["tp1"], modules, per_stage=True)
    plan, solution = _plan(uneven, modules, per_stage=True)
    assert plan == reference and len({str(p) for p in plan.modules.values()}) > 1
    assert min(solution.stage_fp4_fraction.values()) >= 0.5 - 1e-9


@pytest.mark.integration
def test_tensor_parallel_split_off_block_boundaries_is_recorded(parallel):
    tp2 = parallel["tp2"]["modules"]
    # SwiGLU's fc1 holds two slices of 80 rows per rank, fc2 80 input columns: not mxfp4's 32.
    for layer in range(4):
        for module in ("mlp.linear_fc1", "mlp.linear_fc2"):
            m = tp2[f"decoder.layers.{layer}.{module}"]
            assert set(m["errors"]) == {"fp8", "nvfp4"} and "cannot run mxfp4" in m["unsupported"]["mxfp4"]
        assert set(tp2[f"decoder.layers.{layer}.self_attention.linear_qkv"]["errors"]) == set(FORMATS)
    assert parallel["pp2"]["stages"] == [0, 1] and parallel["pp2"]["loss"] == pytest.approx(parallel["tp1"]["loss"])
    # PP2 x VPP2: each rank probes its two chunks; modules carry their physical stage (chunk c on rank c mod 2)
    assert parallel["pp2vpp2"]["stages"] == [0, 1]
    assert {m["layer"]: m["stage"] for m in parallel["pp2vpp2"]["modules"].values()} == {0: 0, 1: 1, 2: 0, 3: 1}


def test_noise_is_layout_invariant():
    """A shard's noise is the full tensor's noise split the way megatron splits the weight."""
    from megatron_snip.snip.noise import global_flat_index, noise_key, rademacher

    key = noise_key(0, "param", 0, "decoder.layers.0.mlp.linear_fc1.weight")
    full_shape, size = (12, 8), 2
    full = rademacher(torch.arange(math.prod(full_shape)), key).view(full_shape)
    assert set(full.unique().tolist()) == {-1.0, 1.0}
    for dim in (0, 1):
        for stride in (1, 2):
            local_shape = list(full_shape)
            local_shape[dim] //= size
            # megatron's _initialize_affine_weight_cpu: chunks of local/stride, rank r takes r::size
            chunks = torch.split(full, local_shape[dim] // stride, dim=dim)
            for rank in range(size):
                expected = torch.cat(chunks[rank::size], dim=dim)
                got = rademacher(global_flat_index(local_shape, partition_dim=dim, stride=stride, rank=rank,
                                                   size=size), key).view(local_shape)
                assert torch.equal(got, expected), (dim, stride, rank)
                part = global_flat_index(local_shape, partition_dim=dim, stride=stride, rank=rank, size=size,
                                         start=7, end=31)
                assert torch.equal(rademacher(part, key), expected.reshape(-1)[7:31])
    # Independent streams: means near 0, neighbours and keys uncorrelated (4 sigma of 1/sqrt(n)).
    n = 1 << 16
    a, b = rademacher(torch.arange(n), key), rademacher(torch.arange(n), noise_key("another"))
    for value in (a.mean(), (a[1:] * a[:-1]).mean(), (a * b).mean()):
        assert abs(value.item()) < 4 / math.sqrt(n)


def test_one_hash_gives_eight_independent_draws():
    """rademacher_bits: bit 7 is rademacher's sign; the eight bits are independent fair draws (means, pairwise
    correlations and neighbours within 4 sigma of 1/sqrt(n))."""
    from megatron_snip.snip.noise import noise_key, rademacher, rademacher_bits

    n, key = 1 << 16, noise_key(0, "param", 0, "decoder.layers.0.mlp.linear_fc1.weight")
    bits = rademacher_bits(torch.arange(n), key)
    assert bits.dtype == torch.uint8
    signs = [((bits >> j) & 1).float().mul(-2.0).add(1.0) for j in range(8)]
    assert torch.equal(signs[7], rademacher(torch.arange(n), key))
    for j, a in enumerate(signs):
        assert abs(a.mean().item()) < 4 / math.sqrt(n) and abs((a[1:] * a[:-1]).mean().item()) < 4 / math.sqrt(n)
        for b in signs[j + 1:]:
            assert abs((a * b).mean().item()) < 4 / math.sqrt(n)


def _sign_bits_in_chunks(chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    import megatron_snip.snip.noise as noise

    param = torch.nn.Parameter(torch.zeros(300, 70))
    whole = noise.param_sign_bits(param, 12345, 37, 20011)
    noise._SIGN_CHUNK = chunk
    return whole, noise.param_sign_bits(param, 12345, 37, 20011)


@pytest.mark.integration
def test_parameter_signs_hashed_in_chunks_are_the_whole_slice_s(tmp_path):
    """param_sign_bits hashes a large parameter a chunk at a time: the same bits as in one go."""
    from megatron_snip.snip.noise import rademacher_bits

    whole, chunked = in_world_of_one(_sign_bits_in_chunks, 1000, tmp_path=tmp_path)
    assert torch.equal(chunked, whole) and torch.equal(whole, rademacher_bits(torch.arange(21000), 12345)[37:20011])


def _context_parallel_part(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Dim 0 (the sequence) of ``full`` as megatron-core's get_batch_on_this_cp_rank gives it to CP rank
    ``rank`` of ``size``: 2 x size chunks, chunks rank and 2 x size - 1 - rank."""
    chunks = full.chunk(2 * size, dim=0)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=0)


def test_context_parallel_positions_are_megatrons_head_tail_chunks():
    from megatron_snip.snip.noise import context_parallel_positions

    # A sequence of 8 at CP=2: rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2.
    assert context_parallel_positions(4, 0, 2).tolist() == [0, 1, 6, 7]
    assert context_parallel_positions(4, 1, 2).tolist() == [2, 3, 4, 5]
    assert context_parallel_positions(6, 0, 1).tolist() == list(range(6))  # CP=1: the sequence in order
    sequence = torch.arange(48)
    for size in (2, 3, 4):
        seen = []
        for rank in range(size):
            got = context_parallel_positions(48 // size, rank, size)
            assert torch.equal(got, _context_parallel_part(sequence, rank, size)), (size, rank)
            seen += got.tolist()
        assert sorted(seen) == list(range(48))  # every token on exactly one rank
    with pytest.raises(ValueError, match="two equal chunks"):
        context_parallel_positions(5, 0, 2)


# (partition_dim, stride, TP size) of a linear's output [s, b, h] as the probes draw its noise: replicated,
# column-parallel (features split, SwiGLU's fc1 in two strided slices), row-parallel under sequence parallelism.
OUTPUT_SPLITS = ((None, 1, 1), (-1, 1, 2), (-1, 2, 2), (0, 1, 2))


def test_context_parallel_noise_is_the_full_sequences():
    """An activation's noise under context parallelism (with TP's feature split or sequence parallelism
    within it) is the CP=1 tensor's noise at the tokens the rank holds: a CP run's probes perturb every
    token as a CP=1 run's do."""
    from megatron_snip.snip.noise import global_flat_index, noise_key, rademacher

    key = noise_key(0, "output", 1, "decoder.layers.2.self_attention.linear_proj")
    seq, batch, hidden = 16, 3, 8
    full = rademacher(torch.arange(seq * batch * hidden), key).view(seq, batch, hidden)
    for cp in (2, 4):
        for dim, stride, tp in OUTPUT_SPLITS:
            for cp_rank in range(cp):
                part = _context_parallel_part(full, cp_rank, cp)
                for rank in range(tp):
                    if dim == 0:  # sequence parallelism: contiguous slices of the CP rank's tokens
                        expected = part.chunk(tp, dim=0)[rank]
                    elif dim == -1:
                        expected = torch.cat(part.split(hidden // tp // stride, dim=-1)[rank::tp], dim=-1)
                    else:
                        expected = part
                    kwargs = dict(partition_dim=dim, stride=stride, rank=rank, size=tp, cp_rank=cp_rank, cp_size=cp)
                    got = rademacher(global_flat_index(expected.shape, **kwargs), key)
                    assert torch.equal(got.view(expected.shape), expected), (cp, dim, stride, cp_rank, rank)
                    part_index = global_flat_index(expected.shape, start=5, end=37, **kwargs)
                    assert torch.equal(rademacher(part_index, key), expected.reshape(-1)[5:37])


def _grid_statistics(tokens, weight_values, update_terms, preconditioner, *, dp, cp, dp_sharded):
    """One module's statistics as the probes reduce them on a DP x CP grid of ranks, each rank's sums
    computed from its own tokens as the probe computes them (a sum over the tokens, a quantity of the
    weight alone, the wgrad error summed over the CP ranks before it is squared against this rank's
    preconditioner), then weighted, added over dp-cp and divided (``probes.reduction_factors``).

    ``tokens``: per replica, key -> [tokens] per-token contributions; ``weight_values``: key -> value;
    ``update_terms``: per replica, [tokens, params] per-token wgrad error terms; ``preconditioner``: [params]."""
    from megatron_snip.snip.noise import context_parallel_positions
    from megatron_snip.snip.reductions import reduction_factors

    keys = list(tokens[0])
    total = torch.zeros(len(keys), dtype=torch.float64)
    n_tokens, n_params = update_terms[0].shape
    for d in range(dp):
        # The wgrad error of the replica: every CP rank's part, all-reduced before squaring.
        parts = [update_terms[d][context_parallel_positions(n_tokens // cp, r, cp)].sum(0) for r in range(cp)]
        error = sum(parts)
        for r in range(cp):
            mine = context_parallel_positions(n_tokens // cp, r, cp)
            shard = slice(None)
            if dp_sharded:  # the distributed optimizer's shard of this rank (dp-cp rank d * cp + r)
                size = n_params // (dp * cp)
                shard = slice((d * cp + r) * size, (d * cp + r + 1) * size)
            local = {}
            for key in keys:
                if key.quantity in weight_values:
                    local[key] = weight_values[key.quantity]
                elif key.quantity == "update_sq":
                    local[key] = (preconditioner[shard] * error[shard]).square().sum()
                else:
                    local[key] = tokens[d][key][mine].sum()
            weights, _ = reduction_factors(keys, cp_rank=r, dp=dp, dp_sharded=dp_sharded)
            total += torch.tensor([local[k] * w for k, w in zip(keys, weights)], dtype=torch.float64)
    _, divisors = reduction_factors(keys, cp_rank=0, dp=dp, dp_sharded=dp_sharded)
    return dict(zip(keys, (total / torch.tensor(divisors, dtype=torch.float64)).tolist()))


def test_statistics_reduce_over_context_parallel_ranks_to_the_cp1_values():
    """Each statistic reduced over a CP x DP grid equals the CP=1 value: token sums added over the CP
    ranks of a replica and averaged over replicas, the weight's own quantities and the update drift (its
    error summed before squaring) counted once, the distributed optimizer's shard-wise sums added."""
    from megatron_snip.snip.module_probe import CLEAN_QUANTITIES, FORMAT_QUANTITIES, Sum

    g = torch.Generator().manual_seed(0)
    n_tokens, n_params = 24, 16
    keys = ([Sum(q) for q in CLEAN_QUANTITIES] + [Sum(q, "nvfp4") for q in FORMAT_QUANTITIES]
            + [Sum("curvature", probe=0), Sum("gain", probe=0), Sum("propagated", "nvfp4", probe=0)])
    weight_values = {"weight_sq": 3.5, "w_quant_sq": 0.25}

    def replica():
        return {k: torch.randn(n_tokens, generator=g, dtype=torch.float64) for k in keys}

    preconditioner = torch.rand(n_params, generator=g, dtype=torch.float64)
    for dp, dp_sharded in ((2, False), (1, True), (2, True)):
        tokens = [replica() for _ in range(dp)]
        # With the distributed optimizer and DP > 1 each shard's drift comes from its own replica's error:
        # layouts agree only when the replicas see the same batch (as in the layout test below).
        update_terms = [torch.randn(n_tokens, n_params, generator=g, dtype=torch.float64)] * dp if dp_sharded else [
            torch.randn(n_tokens, n_params, generator=g, dtype=torch.float64) for _ in range(dp)]
        reference = _grid_statistics(tokens, weight_values, update_terms, preconditioner, dp=dp, cp=1,
                                     dp_sharded=dp_sharded)
        for cp in (2, 4):
            got = _grid_statistics(tokens, weight_values, update_terms, preconditioner, dp=dp, cp=cp,
                                   dp_sharded=dp_sharded)
            for key in keys:
                assert got[key] == pytest.approx(reference[key], rel=1e-12), (dp, dp_sharded, cp, key)
        # The CP=1 values themselves: a replica's token sums averaged, the weight's once, the drift of each
        # replica's whole error averaged (under the distributed optimizer summed over the shards, each
        # replica's error on its own: the same error here).
        drifts = [(preconditioner * terms.sum(0)).square().sum() for terms in update_terms]
        assert reference[Sum("input_sq")] == pytest.approx(sum(t[Sum("input_sq")].sum() for t in tokens) / dp)
        assert reference[Sum("weight_sq")] == weight_values["weight_sq"]
        assert reference[Sum("update_sq", "nvfp4")] == pytest.approx(sum(drifts) / dp)


def test_reference_gemms_may_run_on_tf32_only_where_it_rounds_no_operand():
    """The clean pass's fp32 reference GEMMs run on TF32 tensor cores (CUDA) for 16-bit operands and a
    power-of-2 loss scale: TF32 keeps 10 fraction bits, so such values pass unrounded (checked here by
    rounding to TF32 by hand) and their products are exact in fp32; an fp32 operand would be rounded."""
    from megatron_snip.snip.module_probe import _tf32_exact

    def to_tf32(t: torch.Tensor) -> torch.Tensor:  # round to nearest even, 13 of fp32's 23 fraction bits dropped
        bits = t.view(torch.int32)
        rounded = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
        return rounded.view(torch.float32)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    for dtype in (torch.bfloat16, torch.float16):
        values = x.to(dtype).float()
        values = values[values.isfinite()]
        assert torch.equal(to_tf32(values), values) and torch.equal(to_tf32(values / 8), values / 8), dtype
    assert not torch.equal(to_tf32(x), x)
    bf16, fp16, fp32 = torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16), torch.ones(2)
    assert _tf32_exact(bf16, bf16, bf16, scale=1.0) and _tf32_exact(fp16, bf16, fp16, scale=2.0**-14)
    assert not _tf32_exact(bf16, fp32, bf16, scale=1.0) and not _tf32_exact(bf16, bf16, bf16, scale=3.0)


def test_perturbed_parameters_are_restored_from_the_main_copy_only_where_it_gives_them_bit_for_bit():
    from megatron_snip.snip.adam_view import AdamSlice

    g = torch.Generator().manual_seed(0)
    main = torch.randn(64, generator=g)
    param = torch.nn.Parameter(torch.cat([torch.zeros(16), main]).to(torch.bfloat16))  # a shard: elements 16:80

    def view(main_tensor, param=param):
        return AdamSlice(param, "w", 16, 80, {}, {}, True, True, main_tensor)

    torch.testing.assert_close(view(main).main_as_param(), param.detach()[16:], rtol=0, atol=0)
    other = main.clone()
    other[3] += 1.0
    assert view(other).main_as_param() is None  # the model's copy is not the cast of this main
    assert view(None).main_as_param() is None
    fp32 = torch.nn.Parameter(torch.randn(80, generator=g))
    shard = fp32.detach().view(-1)[16:80]  # the distributed optimizer's main of an fp32 parameter: a view
    assert view(shard, fp32).main_as_param() is None and view(fp32, fp32).main_as_param() is None


@pytest.mark.cuda  # compiled and run on the GPU when there is one (bench/gpu_suite.py), else interpreted
def test_the_fused_noise_kernel_draws_the_references_values():
    """The Triton kernel the probes use on CUDA (here in Triton's interpreter) gives, bit for bit, the
    torch reference's noise for every tensor- and context-parallel layout and slice, for indices past 2^32
    and keys past 2^63."""
    pytest.importorskip("triton")
    from megatron_snip.snip import noise_triton
    from megatron_snip.snip.noise import ShardIndex, global_flat_index, layout_rademacher, noise_key, rademacher

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keys = [noise_key(0, "output", 1, "decoder.layers.3.mlp.linear_fc1"), 0xFFFFFFFFFFFFFFFF, 0x80000000]
    tensor_parallel = ((None, 1, 0, 1), (0, 1, 1, 2), (1, 2, 1, 2), (-1, 2, 0, 4), (1, 1, 3, 4))
    layouts = [dict(partition_dim=dim, stride=stride, rank=rank, size=size)
               for dim, stride, rank, size in tensor_parallel]
    layouts += [dict(partition_dim=dim, stride=stride, rank=size - 1, size=size, cp_rank=cp_rank, cp_size=cp)
                for dim, stride, size in OUTPUT_SPLITS for cp, cp_rank in ((2, 0), (3, 1))]
    for key in keys:
        for layout in layouts:
            shape = (6, 8, 16)
            for start, end in ((0, None), (5, 700)):
                expected = rademacher(global_flat_index(shape, start=start, end=end, device=device, **layout), key)
                kwargs = {**layout, "start": start, "end": end}
                assert torch.equal(layout_rademacher(shape, key, device=device, **kwargs), expected), kwargs
                if device == "cpu":  # layout_rademacher takes the kernel on CUDA only: call it here
                    index = ShardIndex.of(shape, **layout)
                    got = noise_triton.rademacher(expected.numel(), key, start=start, **vars(index))
                    assert torch.equal(got, expected), kwargs
        far = 2**33 + 12345  # the index's high word enters the hash
        got = noise_triton.rademacher(300, key, start=far, **vars(ShardIndex.of((2**34,), device=device)))
        assert torch.equal(got, rademacher(torch.arange(far, far + 300, device=device), key))


@pytest.mark.integration
def test_a_gain_exclude_naming_no_parameter_is_refused_at_start_up(tiny_data, tmp_path):
    """A mistyped --snip-gain-exclude would measure the default gains without a word: refused once
    the model is built (on both pipeline stages), before the first iteration, naming the flag."""
    run = train_args(tiny_data, "--snip", "--snip-interval", "4", "--snip-gain-exclude", "embeding",
                     "--pipeline-model-parallel-size", "2", "--save", str(tmp_path / "ckpt"), iters=4)
    proc = launch(2, run, check=False)
    assert proc.returncode != 0
    assert "error: --snip-gain-exclude embeding: names no parameter of the model" in proc.stderr
    assert "iteration        1/" not in proc.stdout
    assert "megatron_snip/" not in proc.stderr  # one line, no traceback of ours (torchrun prints its own)
