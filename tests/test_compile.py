"""--torch-compile: every transformer layer one graph (no frame given up, no graph break, no recompile after the
first iteration, read from dynamo's counters), for bf16 and for a mixed plan; compiled layers compute what eager
ones do; a re-plan compiles at most one graph per new pattern of BF16 and quantized linears; SNIP's hooks run in
the eager stance; and compiled training gives eager training's losses, at TP=2 across a re-plan, over 20 iterations
for bf16 and a SNIP plan with FP8 and FP4 modules, and under recomputation and context parallelism. On a CPU the
compiled path runs with the aot_eager backend (traced graphs, eager kernels) except where inductor is named; the
compile flags themselves are checked without a process."""

from __future__ import annotations

import pytest
import torch
from conftest import in_world_of_one, launch, run_config, scalars, train_args
from test_parallel import LOSS, assert_close

from megatron_snip.arguments.errors import ArgumentError
from megatron_snip.numerics.recipes import Precision
from megatron_snip.training import tags

SEQ = 32
# A mixed plan over the tiny model's 16 linears (4 layers x qkv, proj, fc1, fc2): FP8 (current and delayed scaling,
# MXFP8), NVFP4 and MXFP4, BF16 among them; its layers hold 4 different patterns of BF16 / quantized linears.
MIXED = ("bf16", "fp8", "nvfp4", "fp8:mxfp8", "fp8:delayed/bf16", "bf16", "nvfp4/mxfp4")


def _build(compiled: bool, swiglu_fusion: bool = False, backend: str = "aot_eager"):
    """A TP1 model built by the trainer's builders from fixed seeds, compiled with ``backend`` or not;
    ``swiglu_fusion``: with megatron-core's fused SwiGLU (a CUDA default, forced on here)."""
    from megatron.core import tensor_parallel

    from megatron_snip.model.llama import build_model, transformer_config

    extra = ("--torch-compile", "--torch-compile-backend", backend) if compiled else ()
    run = run_config("--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), *extra)
    torch.manual_seed(123)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    config = transformer_config(run.model, run.parallel)
    config.bias_activation_fusion = swiglu_fusion
    (model,) = build_model(run.model, run.parallel, config, 128)
    return model


def _linears(model):
    from megatron_snip.model.quantized.layers import PlanLinear

    return [m for m in model.modules() if isinstance(m, PlanLinear)]


def _set_plan(model, names) -> None:
    for i, linear in enumerate(_linears(model)):
        linear.precision = Precision.parse(names[i % len(names)])


def _loss_and_grads(model, tokens):
    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def _steps(model, tokens, n: int = 2) -> tuple[list, list[dict]]:
    """``n`` forward-backward passes: their (loss, grads), and dynamo's counters after each."""
    from megatron_snip.model.compile import counters

    results, seen = [], []
    for _ in range(n):
        results.append(_loss_and_grads(model, tokens))
        seen.append(counters())
    return results, seen


def _reset() -> None:
    """dynamo's caches and counters emptied."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def checks() -> dict:
    from megatron_snip.model.compile import counters, eager_layers
    from megatron_snip.numerics.linear_op import kept_count

    tokens = torch.randint(0, 128, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    eager = _build(False)
    out = {"eager": _loss_and_grads(eager, tokens)}
    _reset()
    model = _build(True)
    # What a checkpoint holds of the model: the same keys and values compiled or not (a fresh build of each).
    out["state"] = [{k: v for k, v in m.state_dict().items() if torch.is_tensor(v)} for m in (_build(False), model)]
    out["sharded_keys"] = [sorted(m.sharded_state_dict()) for m in (eager, model)]
    out["compiled"], out["bf16_counters"] = _steps(model, tokens)
    # Re-plans between steps, as a SNIP cycle makes them: a format changes within a pattern (no graph), then a
    # layer's pattern of BF16 / quantized linears changes (one graph, once).
    linears = _linears(model)
    linears[1].precision = Precision.parse("fp8")  # layer 0: proj quantized, a new pattern
    out["replanned"], out["replanned_counters"] = _steps(model, tokens)
    linears[1].precision = Precision.parse("nvfp4")  # the same pattern, another format
    out["reformatted"], out["reformatted_counters"] = _steps(model, tokens, 1)
    eager = _build(False)
    _linears(eager)[1].precision = Precision.parse("nvfp4")
    out["reformatted_eager"] = _loss_and_grads(eager, tokens)
    # A hook on a linear (what SNIP's probes add) runs in the eager stance, and leaves the graphs as they were.
    seen = []
    handle = linears[0].register_forward_hook(lambda module, args, output: seen.append(output[0].shape))
    with eager_layers():
        out["hooked"] = _loss_and_grads(model, tokens)
    handle.remove()
    out["hook_calls"], out["after_hook"] = len(seen), _steps(model, tokens, 1)[1][-1]
    with torch.no_grad():
        model.eval()
        positions = torch.arange(SEQ).expand(2, SEQ)
        out["eval"] = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean().item()
    out["eval_counters"] = counters()
    # A mixed plan on a fresh compile: one graph per pattern in the first step, nothing more after it.
    mixed_eager = _build(False)
    _set_plan(mixed_eager, MIXED)
    out["mixed_eager"] = [_loss_and_grads(mixed_eager, tokens) for _ in range(2)]
    out["mixed_patterns"] = len({tuple(m.precision.is_bf16 for m in _linears(mixed_eager)[i:i + 4])
                                 for i in range(0, 16, 4)})
    for backend in ("aot_eager", "inductor"):
        _reset()
        mixed = _build(True, backend=backend)
        _set_plan(mixed, MIXED)
        out[f"mixed_{backend}"], out[f"mixed_{backend}_counters"] = _steps(mixed, tokens)
        del mixed
    import gc

    gc.collect()
    out["kept"] = kept_count()  # what the quantized operator kept for backward passes: nothing, once they ran
    # megatron-core's fused SwiGLU (its own autograd function, jit-compiled) traced into the compiled layers
    with torch.compiler.set_stance("force_eager"):  # its kernels eager, not inductor's (a minute on 2 cores)
        out["swiglu_eager"] = _loss_and_grads(_build(False, swiglu_fusion=True), tokens)
    out["swiglu_compiled"] = _loss_and_grads(_build(True, swiglu_fusion=True), tokens)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return in_world_of_one(checks, tmp_path=tmp_path_factory.mktemp("compile"))


def _assert_same(got, want, rel: float):
    (loss, grads), (want_loss, want_grads) = got, want
    assert loss == pytest.approx(want_loss, rel=rel)
    assert sorted(grads) == sorted(want_grads)
    for name, grad in want_grads.items():
        assert (grads[name] - grad).abs().max() <= rel * grad.abs().max(), name


def _whole(counters: dict) -> None:
    """Every layer call one graph: no frame given up, no graph break."""
    assert counters["frames_given_up"] == 0 and counters["graph_breaks"] == 0, counters


@pytest.mark.integration
def test_a_bf16_model_compiles_to_one_graph(results):
    """One graph serves every layer (4 here), from the first step on: no graph break, no frame given up, no
    recompile (the first layer's input gets the strides of the others')."""
    first, second = results["bf16_counters"]
    _whole(second)
    assert first == second and first["graphs"] == 1 and first["recompiles"] == 0


@pytest.mark.integration
def test_a_mixed_plan_compiles_one_graph_per_pattern_in_the_first_step_only(results):
    for backend in ("aot_eager", "inductor"):
        first, second = results[f"mixed_{backend}_counters"]
        _whole(second)
        assert first == second, backend  # nothing compiled after the first step
        assert first["graphs"] == results["mixed_patterns"] == 4 and first["recompiles"] == 3, first


@pytest.mark.integration
def test_checkpoints_hold_the_same_model_compiled_or_not(results):
    eager, compiled = results["state"]
    assert eager.keys() == compiled.keys() and all(torch.equal(eager[k], compiled[k]) for k in eager)
    assert results["sharded_keys"][0] == results["sharded_keys"][1]


@pytest.mark.integration
def test_compiled_layers_compute_what_eager_layers_do(results):
    """aot_eager runs the traced graphs with eager kernels: the forward is the same to the bit, the backward
    differs only in the order of a few fp32 sums (the norms' backward is traced from its decomposition)."""
    (loss, _), (want, _) = results["compiled"][0], results["eager"]
    assert loss == want
    _assert_same(results["compiled"][0], results["eager"], rel=1e-6)


@pytest.mark.integration
def test_quantized_linears_compile_to_the_eager_bits(results):
    """The quantized GEMMs run inside the graph as one operator that computes what the eager autograd function
    does: with aot_eager the same bits, forward and backward, for FP8 (current, delayed, MXFP8) and FP4 (NVFP4,
    MXFP4); with inductor the same to fp32 rounding of the fused code around them."""
    for step in range(2):
        got, want = results["mixed_aot_eager"][step], results["mixed_eager"][step]
        assert got[0] == want[0]
        _assert_same(got, want, rel=0.0)
        _assert_same(results["mixed_inductor"][step], want, rel=1e-5)
    assert results["kept"] == 0


@pytest.mark.integration
def test_a_replan_compiles_at_most_one_graph_per_new_pattern(results):
    before = results["bf16_counters"][-1]
    new_pattern, formats_only = results["replanned_counters"], results["reformatted_counters"]
    assert new_pattern[0]["graphs"] == before["graphs"] + 1 and new_pattern[1] == new_pattern[0]
    assert formats_only[-1] == new_pattern[-1]  # fp8 -> nvfp4 within the pattern: no graph
    _whole(formats_only[-1])
    _assert_same(results["reformatted"][0], results["reformatted_eager"], rel=1e-6)
    assert results["replanned"][0][0] != results["compiled"][0][0]  # the new precisions did run


@pytest.mark.integration
def test_hooks_run_in_the_eager_stance_and_the_graphs_stay(results):
    """SNIP's probes hook the linears: under ``eager_layers`` the layers' Python runs, hooks included; the graphs
    serve the next step unchanged."""
    assert results["hook_calls"] == 1
    # the same forward (NVFP4's stochastic rounding of dY has moved on: the gradients are another draw)
    assert results["hooked"][0] == pytest.approx(results["reformatted_eager"][0], rel=1e-6)
    assert results["after_hook"] == results["reformatted_counters"][-1]


@pytest.mark.integration
def test_no_grad_compiles_once_more(results):
    """Evaluation's no-grad forward: one more graph per pattern in the model (layer 0's and the others')."""
    assert results["eval"] == pytest.approx(results["reformatted_eager"][0], rel=1e-6)  # no_grad graphs, same plan
    assert results["eval_counters"]["graphs"] == results["reformatted_counters"][-1]["graphs"] + 2
    _whole(results["eval_counters"])


@pytest.mark.integration
def test_megatrons_swiglu_fusion_compiles_into_the_layers(results):
    _assert_same(results["swiglu_compiled"], results["swiglu_eager"], rel=1e-6)
    _assert_same(results["swiglu_eager"], results["eager"], rel=1e-5)  # the fused SwiGLU computes SwiGLU


def test_compile_flags_are_validated_and_compile_is_on_by_default_where_it_pays():
    from megatron_snip.arguments import parse_args, resolve
    from megatron_snip.model.config import COMPILE_BY_DEFAULT

    assert not run_config().model.torch_compile  # not on a CPU
    config = run_config("--torch-compile")
    assert config.model.torch_compile and config.model.torch_compile_backend == "inductor"
    assert not config.model.torch_compile_by_default  # asked for: a failing compile fails the run
    from conftest import TINY_MODEL

    def on_a_gpu(*flags):
        return resolve(parse_args([*TINY_MODEL, "--train-iters", "1", *flags]), world_size=1, cuda=True,
                       check_files=False).model

    gpu = on_a_gpu()
    assert gpu.torch_compile == gpu.torch_compile_by_default == COMPILE_BY_DEFAULT["cuda"]
    assert not on_a_gpu("--no-torch-compile").torch_compile
    assert not on_a_gpu("--hidden-dropout", "0.1").torch_compile  # the default gives way where compile cannot run
    with pytest.raises(ArgumentError, match="--torch-compile with dropout"):
        run_config("--torch-compile", "--hidden-dropout", "0.1")
    with pytest.raises(ArgumentError, match="^--torch-compile-backend 'eager': expected one of 'inductor', "):
        run_config("--torch-compile", "--torch-compile-backend", "eager")


COMPILED = ("--torch-compile", "--torch-compile-backend", "aot_eager")


def _eager_and_compiled(tiny_data, tmp_path, nproc: int, *flags: str, iters: int) -> tuple[dict, dict, str]:
    """The losses of an eager and of a compiled run with ``flags``, and the compiled run's output."""
    losses, log = {}, ""
    for name, extra in (("eager", ()), ("compiled", COMPILED)):
        tb = tmp_path / name
        proc = launch(nproc, train_args(tiny_data, *flags, "--tensorboard-dir", str(tb), *extra, iters=iters))
        losses[name] = scalars(tb, LOSS)
        log = proc.stdout + proc.stderr
    return losses["eager"], losses["compiled"], log


def _compile_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("[compile]")]


@pytest.mark.integration
def test_compiled_training_matches_eager_at_tp2_across_a_replan(tiny_data, init_ckpt, tmp_path):
    """TP=2 with sequence parallelism (the linears' collectives traced as functional ones), the plan changed at
    step 3 by a precision schedule (every forward GEMM in fp8): the losses of eager training, to the last
    digits before the re-plan; after it fp8's rounding amplifies the backward's 1e-8 differences. One graph, no
    break."""
    eager, compiled, log = _eager_and_compiled(
        tiny_data, tmp_path, 2, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--precision-schedule",
        "fwd=fp8@3", "--load", str(init_ckpt), "--no-load-optim", "--no-load-rng", iters=5)
    before = {step: loss for step, loss in eager.items() if step < 3}
    assert_close({step: compiled[step] for step in before}, before, rel=1e-6)
    assert_close(compiled, eager, rel=2e-4)
    assert "0 graph break(s), 0 frame(s) given up" in _compile_lines(log)[0], _compile_lines(log)


@pytest.mark.integration
@pytest.mark.parametrize("flags", [(), ("--snip", "--snip-fp4-target", "0.5", "--snip-formats", "fp8", "nvfp4",
                                        "--snip-interval", "5", "--snip-probe-passes", "1")], ids=["bf16", "snip"])
def test_twenty_compiled_iterations_give_the_eager_losses(tiny_data, tmp_path, flags):
    """bf16, and a SNIP run whose cycles (probe passes in the eager stance) put FP8 and NVFP4 modules in the plan
    from iteration 6 on: the losses of 20 iterations agree to fp32's tolerance."""
    eager, compiled, log = _eager_and_compiled(tiny_data, tmp_path, 1, *flags, "--lr-decay-style", "constant",
                                               iters=20)
    assert_close(compiled, eager, rel=1e-5)
    for line in _compile_lines(log):
        assert "0 graph break(s), 0 frame(s) given up" in line, line
    if flags:
        fp4, fp8 = (scalars(tmp_path / "compiled", tag) for tag in (tags.FP4_FRACTION, tags.FP8_FRACTION))
        assert 0 < fp4[20] < 1 and 0 < fp8[20] < 1, (fp4, fp8)


@pytest.mark.integration
@pytest.mark.parametrize("nproc,flags", [
    (1, ("--recompute-granularity", "full", "--recompute-method", "uniform")),
    (1, ("--recompute-granularity", "selective")),
    (2, ("--context-parallel-size", "2")),
], ids=["recompute-full", "recompute-selective", "cp2"])
def test_recomputation_and_context_parallelism_run_compiled(tiny_data, tmp_path, nproc, flags):
    """Full recomputation (megatron-core's checkpoint around compiled layers; the layer's no-grad and grad
    graphs) and context parallelism (the K/V all-gather traced) compile whole; selective recomputation
    checkpoints the core attention with torch's checkpoint inside the graph, and breaks it where megatron-core
    reads the mask type from a tensor. Each gives the eager losses."""
    eager, compiled, log = _eager_and_compiled(tiny_data, tmp_path, nproc, *flags, iters=4)
    assert_close(compiled, eager, rel=1e-6)
    (line, *_) = _compile_lines(log)
    assert "0 frame(s) given up" in line, line
    if "selective" not in flags:
        assert "0 graph break(s)" in line, line
