"""The SNIP estimators on toy problems whose answers are known in closed form.

Pure functions only (no process groups): the least-squares model whose loss
Hessian w.r.t. the output is exactly I/n, a random quadratic for the isotropic
second-order rule, a 2-layer linear net for the propagated gain, torch's Adam
for the update sensitivity, plus the statistics' JSON form, and the cost tables
handed to the ILP.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import pytest
import torch

from megatron_snip.snip.config import UPDATE_METRICS
from megatron_snip.snip.estimators import (
    AdamHyper,
    adam_sensitivity,
    adam_update,
    cost_tables,
    divergences,
    forward_loss_divergence,
    hutchinson_trace,
    local_error_baselines,
    metric_scale,
    module_divergences,
    propagated_drift,
    propagated_update_divergence,
    unresolved_curvatures,
    update_normaliser,
)
from megatron_snip.snip.noise import noise_key, rademacher
from megatron_snip.snip.statistics import FormatErrors, ModuleStatistics, ProbeStatistics


def _rademacher(n: int, key: int) -> torch.Tensor:
    return rademacher(torch.arange(n), key).double()


# ----------------------------------------------------------------------------------------------
# Forward: least squares, y = X w, L = 0.5 ||y - t||^2 / n, so d^2L/dy^2 = I / n exactly.


def test_hutchinson_is_exact_on_least_squares():
    g = torch.Generator().manual_seed(0)
    n, d = 200, 7
    x, w, t = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, d), (d,), (n,)))
    y = x @ w

    def grad(y):  # dL/dy
        return (y - t) / n

    sigma = 1e-2 * y.norm().item() / math.sqrt(n)
    for k in range(3):
        z = _rademacher(n, noise_key("lsq", k))
        trace = hutchinson_trace(torch.dot(z, grad(y + sigma * z) - grad(y)).item(), sigma)
        # <Z, H Z> / ... with H = I/n and ||Z||^2 = n for +-1 noise: exactly tr(H) = 1.
        assert trace == pytest.approx(1.0, rel=1e-12)


def test_forward_divergence_is_the_second_order_loss_change():
    g = torch.Generator().manual_seed(1)
    n, d = 300, 5
    x, w, t = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, d), (d,), (n,)))

    def loss(y):
        return 0.5 * ((y - t) ** 2).sum().item() / n

    y = x @ w
    e = 0.05 * torch.randn(n, generator=g, dtype=torch.float64)  # an injected output error
    estimate = forward_loss_divergence(curvature_trace=1.0, output_numel=n, output_err_sq=(e**2).sum().item())
    first_order = torch.dot((y - t) / n, e).item()
    # The loss is quadratic in y: the change is exactly linear + estimate (to rounding).
    assert loss(y + e) - loss(y) == pytest.approx(first_order + estimate, rel=1e-10)
    # ... and the antithetic pair cancels the linear term.
    assert 0.5 * (loss(y + e) + loss(y - e)) - loss(y) == pytest.approx(estimate, rel=1e-10)


def test_forward_difference_trace_is_unbiased_on_a_cubic():
    """Beyond quadratics the forward difference picks up (sigma/2) T[Z,Z,Z], which averages
    to zero over Rademacher draws: L = sum(a y^2 / 2 + b y^3 / 6) has tr H(0) = sum a."""
    g = torch.Generator().manual_seed(3)
    n = 50
    a, b = torch.rand(n, generator=g, dtype=torch.float64) + 0.5, torch.randn(n, generator=g, dtype=torch.float64)

    def grad(y):
        return a * y + b * y**2 / 2

    sigma = 0.3  # large: the third-order term is far from negligible in any single draw
    z = _rademacher(4000 * n, noise_key("cubic")).view(4000, n)
    draws = hutchinson_trace((z * (grad(sigma * z) - grad(torch.zeros(n, dtype=torch.float64)))).sum(1), sigma)
    # A single draw is off by exactly (sigma/2) sum b z (z^3 = z): standard deviation (sigma/2) ||b|| ...
    assert draws.std().item() == pytest.approx(sigma / 2 * b.norm().item(), rel=0.05)
    # ... and the mean of 4000 draws is within 4 standard errors of the trace: no bias.
    assert abs(draws.mean().item() - a.sum().item()) < 4 * sigma / 2 * b.norm().item() / math.sqrt(4000)


def test_isotropic_rule_on_an_anisotropic_quadratic():
    """For E with i.i.d. entries the expected rise 0.5 E^T H E is 0.5 (tr H / n) E||E||^2 whatever H
    is; the Hutchinson trace from few probes carries it."""
    g = torch.Generator().manual_seed(2)
    n = 64
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    h = a @ a.t() / n + torch.diag(torch.rand(n, generator=g, dtype=torch.float64) * 5)  # SPD, anisotropic
    z = _rademacher(3000 * n, noise_key("q")).view(3000, n)
    sigma = 0.1
    grad_diff = (sigma * z) @ h  # G(+sigma z) - G(0) of the quadratic 0.5 y^T H y
    trace = hutchinson_trace((z * grad_diff).sum(1), sigma).mean().item()
    assert trace == pytest.approx(h.trace().item(), rel=0.03)
    errors = 0.02 * torch.randn(4000, n, generator=g, dtype=torch.float64)
    true_rise = 0.5 * torch.einsum("bi,ij,bj->b", errors, h, errors).mean().item()
    estimate = forward_loss_divergence(trace, n, (errors**2).sum(1).mean().item())
    assert estimate == pytest.approx(true_rise, rel=0.05)


# ----------------------------------------------------------------------------------------------
# Backward: 2-layer linear net  h = x A^T (module input), y = h B^T, L = 0.5 ||y - t||^2 / N.
# A dgrad error eX in dL/dh adds eX^T x to A's gradient. With Adam sensitivity S (same shape as A)
# and i.i.d. eX of variance s^2, E||S * (eX^T x)||^2 = s^2 sum_ij S_ij^2 c_j, c_j = sum_n x_nj^2,
# and the gain ||J S||_F^2 (J = dh/dA) is exactly sum_ij S_ij^2 c_j: propagated = gain * s^2.


def _two_layer(seed=3, n=40, d0=6, d1=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d0, generator=g, dtype=torch.float64)
    a = torch.randn(d1, d0, generator=g, dtype=torch.float64)
    s = torch.rand(d1, d0, generator=g, dtype=torch.float64) + 0.1  # Adam's P~ for A
    return g, x, a, s


def test_injected_dgrad_error_enters_lower_gradient_as_ex_t_x():
    g, x, a, s = _two_layer()
    b = torch.randn(3, a.shape[0], generator=g, dtype=torch.float64)
    t = torch.randn(x.shape[0], 3, generator=g, dtype=torch.float64)
    e_x = torch.randn(x.shape[0], a.shape[0], generator=g, dtype=torch.float64)

    def grad_a(error):
        a_ = a.clone().requires_grad_()
        h = x @ a_.t()
        if error is not None:
            h.register_hook(lambda grad: grad + error)
        loss = 0.5 * ((h @ b.t() - t) ** 2).sum() / x.shape[0]
        loss.backward()
        return a_.grad

    torch.testing.assert_close(grad_a(e_x) - grad_a(None), e_x.t() @ x)


def test_propagated_drift_of_a_perturbation_is_the_drift_of_the_realised_error():
    """The probe's propagated term for one realised dgrad error e: every draw perturbs A by sigma S w and reads
    c = <(h(+) - h(0)) / sigma, e> at the module input; the mean of c^2 over draws is ||S * (e^T x)||^2, the
    drift e causes in A's update, whatever e's direction. A coherent error (the same direction at every token,
    as dY (Q(W) - W) is) drifts far more than the isotropic form gain * ||e||^2 / numel(e) says."""
    g, x, a, s = _two_layer()
    sigma, draws = 1e-3, 4000
    w = _rademacher(draws * a.numel(), noise_key("gain")).view(draws, *a.shape)
    dh = (torch.einsum("nj,kij->kni", x, a + sigma * s * w) - (x @ a.t())[None]) / sigma
    # Linear in the parameters: each draw's input change is exactly J (S w)
    torch.testing.assert_close(dh, torch.einsum("nj,kij->kni", x, s * w), rtol=1e-6, atol=1e-9)
    gain = ((s**2) * (x**2).sum(0)).sum().item()  # ||J S||_F^2
    n_h = x.shape[0] * a.shape[0]
    isotropic = 0.3 * torch.randn(x.shape[0], a.shape[0], generator=g, dtype=torch.float64)
    # every token's error along one direction, in proportion to the token's first input feature
    coherent = torch.outer(x[:, 0], torch.randn(a.shape[0], generator=g, dtype=torch.float64))
    for e in (isotropic, coherent):
        truth = ((s * (e.t() @ x)) ** 2).sum().item()
        estimate = propagated_drift(torch.einsum("kni,ni->k", dh, e).tolist())
        spread = math.sqrt(2 / draws) * truth  # each draw one squared projection
        assert abs(estimate - truth) < 4 * spread, (estimate, truth)
    assert propagated_update_divergence(gain, n_h, (coherent**2).sum().item()) < 0.5 * (
        (s * (coherent.t() @ x)) ** 2).sum().item()


def test_isotropic_propagated_term_matches_isotropic_injected_errors():
    """Statistics before version 3: ``gain * ||eX||^2 / numel(X)``, the mean drift of i.i.d. errors."""
    g, x, a, s = _two_layer()
    gain = ((s**2) * (x**2).sum(0)).sum().item()
    n_h = x.shape[0] * a.shape[0]
    e_x = 0.3 * torch.randn(3000, x.shape[0], a.shape[0], generator=g, dtype=torch.float64)
    drifts = ((s * torch.einsum("kni,nj->kij", e_x, x)) ** 2).sum((1, 2))
    estimates = propagated_update_divergence(gain, n_h, (e_x**2).sum((1, 2)))
    assert estimates.mean().item() == pytest.approx(drifts.mean().item(), rel=0.03)


# ----------------------------------------------------------------------------------------------
# Adam


def _adam_history(beta2, steps=300, seed=4, unseen=0):
    """A parameter of 50 elements after ``steps`` Adam steps on a stationary gradient distribution;
    the last ``unseen`` elements never get a gradient (as embedding rows of unseen tokens)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(50, generator=g, dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=1e-2, betas=(0.9, beta2), eps=1e-8)
    scale = torch.rand(50, generator=g, dtype=torch.float64) + 0.5
    for _ in range(steps):
        p.grad = scale * torch.randn(50, generator=g, dtype=torch.float64)
        p.grad[50 - unseen:] = 0.0
        opt.step()
    return g, p, opt, scale


def _torch_step(p, opt, grad):
    """The update (theta_before - theta_after) torch's Adam takes from ``opt``'s state for ``grad``."""
    p_ = torch.nn.Parameter(p.detach().clone())
    o = torch.optim.Adam([p_], **{k: v for k, v in opt.defaults.items() if k in ("lr", "betas", "eps")})
    o.load_state_dict(copy.deepcopy(opt.state_dict()))  # a copy: the state tensors would be shared
    p_.grad = grad.clone()
    o.step()
    return p.detach() - p_.detach()


def _hyper(opt, p):
    lr, (beta1, beta2), eps = opt.defaults["lr"], opt.defaults["betas"], opt.defaults["eps"]
    return AdamHyper(lr, beta1, beta2, eps, float(opt.state[p]["step"]))


@pytest.mark.parametrize("beta2", [0.95, 0.999])
def test_adam_update_is_torchs_next_step_and_its_sensitivity_the_derivative(beta2):
    g, p, opt, scale = _adam_history(beta2)
    state, h = opt.state[p], _hyper(opt, p)
    grad = 0.3 * scale * torch.randn(50, generator=g, dtype=torch.float64)
    predicted = adam_update(state["exp_avg"], state["exp_avg_sq"], grad, h)
    torch.testing.assert_close(predicted, _torch_step(p, opt, grad), rtol=1e-9, atol=1e-15)
    # du/dg against torch's central difference (its error is O(delta^2)).
    delta = 1e-5 * scale
    change = (_torch_step(p, opt, grad + delta) - _torch_step(p, opt, grad - delta)) / 2
    sensitivity = adam_sensitivity(state["exp_avg"], state["exp_avg_sq"], grad, h)
    torch.testing.assert_close(sensitivity * delta, change, rtol=1e-6, atol=1e-16)
    # v' answering g matters at beta2 = 0.95: holding v fixed misses the response by >5% somewhere.
    held = h.lr / (1 - h.beta1 ** (h.step + 1)) * (1 - h.beta1) / (
        (state["exp_avg_sq"] / (1 - beta2**h.step)).sqrt() + h.eps)
    assert float(((held - sensitivity).abs() / sensitivity.abs()).max()) > (0.05 if beta2 == 0.95 else 1e-4)


def test_an_element_that_never_had_a_gradient_is_insensitive_as_in_torch():
    """Elements whose gradient was always 0 (embedding rows of unseen tokens) have v == 0. Their
    next torch step is lr * sign(g) up to bias correction, so a change of the gradient's size
    hardly moves it; holding v at 0 would claim a sensitivity of c / eps (here ~1e5). Where there
    is no gradient now either, the sensitivity is exactly 0."""
    g, p, opt, scale = _adam_history(0.95, steps=30, unseen=10)
    state, h = opt.state[p], _hyper(opt, p)
    assert bool((state["exp_avg_sq"][40:] == 0).all()) and bool((state["exp_avg_sq"][:40] > 0).all())
    grad = 0.3 * torch.randn(50, generator=g, dtype=torch.float64).abs() + 0.1
    sensitivity = adam_sensitivity(state["exp_avg"], state["exp_avg_sq"], grad, h)
    delta = 1e-3 * grad  # same sign: only the gradient's size changes
    change = _torch_step(p, opt, grad + delta) - _torch_step(p, opt, grad)
    assert float(change[40:].abs().max()) < 1e-10 and float(change[:40].abs().min()) > 1e-7
    torch.testing.assert_close(sensitivity * delta, change, rtol=2e-2, atol=1e-10)
    held = h.lr * (1 - h.beta1) / (1 - h.beta1 ** (h.step + 1)) / h.eps  # v fixed at 0
    assert float(sensitivity[40:].abs().max()) < 1e-12 * held
    grad[45:] = 0.0
    assert bool((adam_sensitivity(state["exp_avg"], state["exp_avg_sq"], grad, h)[45:] == 0).all())
    assert bool((adam_update(state["exp_avg"], state["exp_avg_sq"], grad, h)[45:] == 0).all())


def test_the_fisher_metric_keeps_rounding_level_gradients_from_deciding_the_drift():
    """First-seen elements (m = v = 0) whose gradient is at the level of rounding (the embedding rows of tokens
    no step has trained, where another layout's sums round otherwise) sit in Adam's eps window: their response
    P~ reaches A (1 - beta1) / eps. In the paper's metric a handful of them decide the drift a gradient error
    causes, and two layouts' rounding (independent values of the same size there) give drifts far apart. The
    fisher metric weighs each element by its second moment, sqrt(w) P~ <= A (1 - beta1) / 4 in the window: the
    trained elements decide, and the two layouts' drifts agree."""
    g, p, opt, scale = _adam_history(0.95, steps=10, unseen=10)
    state, h = opt.state[p], _hyper(opt, p)
    trained = 0.3 * scale * torch.randn(50, generator=g, dtype=torch.float64)
    error = 0.01 * scale * torch.randn(50, generator=g, dtype=torch.float64)  # a gradient error, every element
    drift = {}
    for layout in range(2):
        grad = trained.clone()
        grad[40:] = 5e-8 * (2 * torch.rand(10, generator=g, dtype=torch.float64) - 1)  # rounding: |g| < ~eps / c
        response = adam_sensitivity(state["exp_avg"], state["exp_avg_sq"], grad, h)
        for metric in UPDATE_METRICS:
            scale_w = metric_scale(state["exp_avg_sq"], grad, h, metric)
            r = response if scale_w is None else response * scale_w
            drift[metric, layout] = (r * error).square()
    paper = [drift["paper", k] for k in range(2)]
    fisher = [drift["fisher", k] for k in range(2)]
    assert all(float(d[40:].sum() / d.sum()) > 0.9 for d in paper)  # the first-seen elements decide
    assert all(float(d[40:].sum() / d.sum()) < 0.05 for d in fisher)
    paper_ratio, fisher_ratio = (float(max(a.sum(), b.sum()) / min(a.sum(), b.sum())) for a, b in (paper, fisher))
    assert paper_ratio > 1.3 and fisher_ratio < 1.01, (paper_ratio, fisher_ratio)
    bound = h.lr / (1 - h.beta1 ** (h.step + 1)) * (1 - h.beta1) / 4
    assert float((drift["fisher", 0][40:].sqrt() / error[40:].abs()).max()) <= bound * (1 + 1e-9)


# ----------------------------------------------------------------------------------------------
# Statistics, normalisation, cost tables


def _module(name, layer, curvature, gain, errors, unsupported=None):
    return ModuleStatistics(
        name=name, layer=layer, stage=0, in_features=8, out_features=16, input_numel=80.0, output_numel=160.0,
        input_sq=80.0, weight_sq=1.0, output_sq=160.0, output_grad_sq=1e-4, curvature=curvature,
        curvature_probes=[curvature], gain=gain, gain_probes=[gain],
        errors={f: FormatErrors(*v) for f, v in errors.items()}, unsupported=unsupported or {})


def _stats(**kw):
    """Two modules' statistics as version 2 files hold them (the paper's metric, no measured propagated part)."""
    modules = {
        "decoder.layers.0.mlp.linear_fc1": _module("decoder.layers.0.mlp.linear_fc1", 0, 3.2, 5.0,
                                                   {"fp8": (0.1, 0.0, 1e-4, 2e-6), "nvfp4": (2.0, 0.1, 1e-3, 4e-5)}),
        "decoder.layers.1.mlp.linear_fc1": _module("decoder.layers.1.mlp.linear_fc1", 1, 0.5, 9.0,
                                                   {"fp8": (0.2, 0.0, 2e-4, 1e-6), "nvfp4": (4.0, -0.1, 3e-3, 2e-5)}),
    }
    return ProbeStatistics(modules=modules, formats=["fp8", "nvfp4"], loss=2.0, update_sq=1e-3,
                           data_parallel_size=kw.get("dp", 1), num_microbatches=2, micro_batch_size=4,
                           seq_length=32, iteration=100, stages=[0])


def test_module_divergences_normalise_and_split_into_parts():
    stats = _stats(dp=4)
    m = stats.modules["decoder.layers.1.mlp.linear_fc1"]
    assert stats.update_metric == "paper" and update_normaliser(stats) == 1e-3  # version 2: ||u||^2
    d = module_divergences(m, loss=2.0, update_norm=1e-3, data_parallel_size=4)["nvfp4"]
    assert d.loss_change == pytest.approx(0.5 * 0.5 * 4.0 / 160.0)
    assert d.forward == pytest.approx(d.loss_change / 2.0)
    assert d.update_local == pytest.approx(2e-5 / 4)
    assert d.update_propagated == pytest.approx(9.0 * 3e-3 / 80.0 / 4)
    assert d.backward == pytest.approx((d.update_local + d.update_propagated) / 1e-3)
    assert d.cost(2.0, 0.5) == pytest.approx(2.0 * d.forward + 0.5 * d.backward)
    assert divergences(stats)["decoder.layers.1.mlp.linear_fc1"]["nvfp4"] == d


def test_the_fisher_metrics_update_divergence_is_the_loss_its_drift_costs():
    """Version 3, the fisher metric: the propagated part is the measured drift of the repeated error plus the
    gain's share of stochastic rounding's (independent from rank to rank: 1/D), and the update divergence is
    the loss the drift costs at the next step, ``0.5 B v_hat du^2``, over the loss: in the loss term's units."""
    stats = _stats(dp=4)
    name = "decoder.layers.1.mlp.linear_fc1"
    m = stats.modules[name]
    m.errors["nvfp4"] = replace(m.errors["nvfp4"], propagated=7e-6, input_grad_noise_sq=2e-3)
    m.errors["fp8"] = replace(m.errors["fp8"], propagated=1e-7)  # rounds to nearest: no noise part
    stats = replace(stats, settings={"update_metric": "fisher"})
    tokens = 2 * 4 * 32 * 4
    assert stats.tokens == tokens and update_normaliser(stats) == pytest.approx(2 * 2.0 / tokens)
    d = divergences(stats)[name]
    assert d["nvfp4"].update_propagated == pytest.approx(7e-6 + 9.0 * 2e-3 / 80.0 / 4)
    assert d["fp8"].update_propagated == pytest.approx(1e-7)
    assert d["nvfp4"].backward == pytest.approx(0.5 * tokens * (2e-5 / 4 + d["nvfp4"].update_propagated) / 2.0)


def test_cost_tables_feed_the_ilp():
    from megatron_snip.snip.ilp import LinearModule, SnipProblem, solve

    stats = _stats()
    tables = cost_tables(stats, alpha=1.0, beta=2.0)
    names = list(stats.modules)
    for name in names:
        assert tables.joint[name]["bf16"] == 0.0
        for fmt in ("fp8", "nvfp4"):
            assert tables.joint[name][fmt] == pytest.approx(tables.forward[name][fmt] + tables.backward[name][fmt])
        assert tables.forward[name]["fp8"] < tables.forward[name]["nvfp4"]
    modules = [LinearModule.from_shape(n, i, 128, 8, 16) for i, n in enumerate(names)]
    plan = solve(SnipProblem(modules, ["bf16", "fp8", "nvfp4"], target=0.5, cost=tables.joint), solver="highs").plan
    assert sorted(plan.values()) == ["bf16", "nvfp4"]  # one module in FP4, the other in free bf16
    cheaper = min(names, key=lambda n: tables.joint[n]["nvfp4"])
    assert plan[cheaper] == "nvfp4"
    split = SnipProblem(modules, ["bf16", "fp8", "nvfp4"], target=0.5, fwd_cost=tables.forward,
                        bwd_cost=tables.backward)
    assert solve(split, solver="highs").meets_target


def test_cost_tables_refuse_unmeasured_pairs_and_clamp_negative_curvature():
    stats = _stats()
    stats.modules["decoder.layers.0.mlp.linear_fc1"].unsupported["mxfp4"] = "cannot run mxfp4: split of 80"
    with pytest.raises(ValueError, match=r"decoder.layers.0.mlp.linear_fc1: mxfp4 \(cannot run mxfp4"):
        cost_tables(stats, formats=["bf16", "fp8", "mxfp4"])
    stats.modules["decoder.layers.1.mlp.linear_fc1"].curvature = -0.1  # a noisy ~0 trace
    assert cost_tables(stats).forward["decoder.layers.1.mlp.linear_fc1"]["fp8"] == 0.0
    stats.loss = None
    with pytest.raises(ValueError, match="gather them across the pipeline"):
        cost_tables(stats)


def test_unresolved_curvatures_are_those_within_two_standard_errors_of_zero():
    """Two draws (a, b): mean (a+b)/2, standard error |a-b|/2, so unresolved iff |a+b|/2 <= |a-b|."""
    stats = _stats()
    first, second = stats.modules
    stats.modules[first].curvature_probes = [3.0, 1.1]  # mean 2.05 > 2 x 0.95
    stats.modules[second].curvature_probes = [3.0, 0.9]  # mean 1.95 <= 2 x 1.05
    assert unresolved_curvatures(stats) == [second]
    assert unresolved_curvatures(stats, z=1.8) == []  # 1.95 > 1.8 x 1.05
    # three draws: mean 0.2, sample sd sqrt(0.13) = 0.3606, standard error 0.2082
    stats.modules[first].curvature_probes = [0.3, -0.2, 0.5]
    assert unresolved_curvatures(stats, z=0.9) == []  # 0.2 > 0.9 x 0.2082
    assert unresolved_curvatures(stats, z=1.0) == [first]  # 0.2 <= 0.2082; 1.95 > 1.05
    assert unresolved_curvatures(stats) == [first, second]
    for m in stats.modules.values():  # one draw (--snip-probe-passes 1) or the Fisher's trace: nothing to judge by
        m.curvature_probes = [m.curvature]
    assert unresolved_curvatures(stats) is None
    for m in stats.modules.values():
        m.curvature_probes = []
    assert unresolved_curvatures(stats) is None


def test_statistics_json_round_trip_and_merge():
    stats = _stats()
    assert ProbeStatistics.from_json(stats.to_json()) == stats
    def part(stage, **changes):
        modules = {k: v for k, v in stats.to_dict()["modules"].items() if f"layers.{stage}." in k}
        return ProbeStatistics.from_dict({**stats.to_dict(), "stages": [stage], "modules": modules, **changes})

    first, second = part(0, loss=None), part(1)
    merged = ProbeStatistics.merge([second, first])
    assert merged.modules == stats.modules and merged.loss == 2.0 and merged.stages == [0, 1]
    with pytest.raises(ValueError, match="more than one part"):
        ProbeStatistics.merge([stats, stats])
    with pytest.raises(ValueError, match="version"):
        ProbeStatistics.from_dict({**stats.to_dict(), "version": 99})


def test_local_error_baselines():
    absolute, relative = local_error_baselines(_stats())
    assert absolute["decoder.layers.1.mlp.linear_fc1"]["nvfp4"] == 4.0
    assert relative["decoder.layers.1.mlp.linear_fc1"]["nvfp4"] == 4.0 / 160.0


def test_operand_error_baselines_sum_every_quantized_tensor_and_rank_unlike_the_output_error():
    """The SNIP paper's baselines: X, W and dY errors summed (absolute, and each over its tensor's
    norm: X 80, W 1, dY 1e-4 in _module). Layer 0's output error is the smaller, its operands' the larger."""
    from megatron_snip.precision.flops import LlamaLinearDims
    from megatron_snip.snip.estimators import operand_error_baselines
    from megatron_snip.snip.ilp import SnipProblem
    from megatron_snip.snip.planner import linear_modules
    from megatron_snip.snip.policies import POLICIES

    stats = _stats()
    operands = {"decoder.layers.0.mlp.linear_fc1": {"x": 0.8, "w": 0.02, "dy": 2e-7},
                "decoder.layers.1.mlp.linear_fc1": {"x": 0.4, "w": 0.01, "dy": 1e-7}}
    for name, errors in operands.items():
        stats.modules[name].errors["nvfp4"].operand_sq = errors
        stats.modules[name].errors["fp8"].operand_sq = {k: v / 16 for k, v in errors.items()}
    absolute, relative = operand_error_baselines(stats)
    assert absolute["decoder.layers.0.mlp.linear_fc1"]["nvfp4"] == pytest.approx(0.8 + 0.02 + 2e-7)
    assert relative["decoder.layers.0.mlp.linear_fc1"]["nvfp4"] == pytest.approx(0.8 / 80 + 0.02 / 1 + 2e-7 / 1e-4)
    assert relative["decoder.layers.1.mlp.linear_fc1"]["fp8"] == pytest.approx((0.4 / 80 + 0.01 + 1e-3) / 16)
    # at a budget of one module's FLOPs in FP4 the paper's baseline picks layer 1, the output-error one layer 0
    dims = LlamaLinearDims(num_layers=2, hidden_size=8, ffn_hidden_size=8, kv_channels=8, num_query_groups=1)
    modules = [m for m in linear_modules(dims, 10) if m.name in operands]
    zero = {m.name: {"bf16": 0.0, "fp8": 0.0, "nvfp4": 0.0} for m in modules}
    problem = SnipProblem(modules, ("bf16", "fp8", "nvfp4"), 0.5, cost=zero, per_stage=False)
    for policy, fp4_layer in (("min-operand-error", 1), ("min-relative-operand-error", 1), ("min-quant-error", 0)):
        plan = POLICIES[policy](problem, stats, 0, "highs")
        assert [n for n, f in plan.items() if f == "nvfp4"] == [f"decoder.layers.{fp4_layer}.mlp.linear_fc1"], policy
    stats.modules["decoder.layers.0.mlp.linear_fc1"].errors["fp8"].operand_sq = None  # statistics version 1
    with pytest.raises(ValueError, match="predates them"):
        operand_error_baselines(stats)


def test_the_loss_term_policy_plans_by_the_loss_divergence_alone():
    """``snip-loss-term`` (policies.POLICIES): the ILP over alpha * dL/loss only; with one of two equal
    modules in FP4 it is the one whose FP4 loss divergence is smaller, whatever the update term says."""
    from megatron_snip.snip.ilp import LinearModule, SnipProblem
    from megatron_snip.snip.policies import POLICIES

    stats = _stats()
    names = sorted(stats.modules)
    formats = ("bf16", "nvfp4")
    problem = SnipProblem([LinearModule.from_shape(n, i, 64, 8, 16) for i, n in enumerate(names)], formats, 0.5,
                          cost=cost_tables(stats, formats=formats).joint)
    d = divergences(stats)
    plan = POLICIES["snip-loss-term"](problem, stats, 0, "highs")
    in_fp4 = [n for n in names if plan[n] == "nvfp4"]
    assert in_fp4 == [min(names, key=lambda n: d[n]["nvfp4"].forward)]
    by_both = min(names, key=lambda n: d[n]["nvfp4"].forward + d[n]["nvfp4"].backward)
    assert [n for n in names if POLICIES["snip"](problem, stats, 0, "highs")[n] == "nvfp4"] == [by_both]
