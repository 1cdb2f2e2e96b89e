"""MIP backends for the SNIP ILP: Gurobi (``gurobipy``) and HiGHS (``highspy``).

Both backends consume the same solver-neutral :class:`MatrixModel` (built by
:func:`megatron_snip.snip.ilp.build_matrix_model`), so they solve literally the
same model; only the translation into each solver's API differs.

Solver choice (``solver=``):

* ``"highs"``: HiGHS, always available (a hard dependency of the project).
* ``"gurobi"``: Gurobi, or :class:`SolverUnavailableError` when gurobipy does not
  import, its license does not admit the model's size, or it fails with a
  ``GurobiError`` (e.g. no license).
* ``"auto"``: Gurobi when it is usable for this model, else HiGHS; the reason
  for falling back is logged on the ``megatron_snip.snip`` logger.

Gurobi's pip wheel ships a size-limited license (at most
:data:`GUROBI_SIZE_LIMIT` variables and as many linear constraints). Models
within that size are handed to Gurobi directly; larger ones only when a
one-off probe shows the installed license is not the size-limited one.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import highspy
import numpy as np

logger = logging.getLogger("megatron_snip.snip")

SOLVERS = ("auto", "gurobi", "highs")

# Gurobi's size-limited (pip) license: at most this many variables and this
# many linear constraints.
GUROBI_SIZE_LIMIT = 2000

# Shared by both backends so they stop at the same points. The budget rows
# have FLOP fractions as coefficients (see ilp.build_matrix_model), so 1e-9
# is an FP4 budget honoured to one part in 1e9 of the FLOPs; the objective
# is scaled so that the largest cost is 1, which makes the absolute gap
# meaningful whatever unit the divergences have.
FEASIBILITY_TOL = 1e-9
MIP_ABS_GAP = 1e-9
# The reduced-cost tolerance of the LP relaxations (Gurobi's OptimalityTol, HiGHS's dual
# feasibility tolerance). At Gurobi's default, 1e-6, a module whose cost is below a millionth of
# the largest counted as free: with a zero FP4 target it could come out in FP4 at a positive
# cost where all-BF16 costs 0 (seen with SNIP costs spanning 1e8 early in training).
OPTIMALITY_TOL = 1e-9


class SolverError(RuntimeError):
    """A solver ran but produced no usable plan (e.g. no solution within the time limit)."""


class SolverInfeasibleError(SolverError):
    """The solver proved that no assignment satisfies the constraints."""


class SolverUnavailableError(SolverError):
    """The explicitly requested solver cannot be used for this model."""


@dataclass(frozen=True)
class MatrixModel:
    """A binary program in matrix form, independent of any solver API.

    minimise ``cost @ x`` over ``x`` in {0, 1}^n_vars subject to, for every
    row r, ``sum_k value[k] * x[col_index[k]]`` (== if ``is_equality[r]``
    else >=) ``rhs[r]``, where k runs over ``row_start[r]:row_start[r+1]``
    (compressed sparse rows).
    """

    cost: np.ndarray  # (n_vars,) float64, objective coefficients
    row_start: np.ndarray  # (n_rows + 1,) int64, CSR row pointers
    col_index: np.ndarray  # (nnz,) int32, column of each entry
    value: np.ndarray  # (nnz,) float64, coefficient of each entry
    rhs: np.ndarray  # (n_rows,) float64, right-hand sides
    is_equality: np.ndarray  # (n_rows,) bool; False means ">="

    @property
    def n_vars(self) -> int:
        return len(self.cost)

    @property
    def n_rows(self) -> int:
        return len(self.rhs)

    def rows(self) -> Iterator[tuple[np.ndarray, np.ndarray, bool, float]]:
        """Yield ``(col_index, value, is_equality, rhs)`` for each row."""
        for r in range(self.n_rows):
            lo, hi = self.row_start[r], self.row_start[r + 1]
            yield self.col_index[lo:hi], self.value[lo:hi], bool(self.is_equality[r]), float(self.rhs[r])


@dataclass(frozen=True)
class BackendResult:
    """What a backend returns, in the units of the :class:`MatrixModel`."""

    solver: str  # "gurobi" or "highs"
    x: np.ndarray  # (n_vars,) bool, the chosen binary values
    bound: float  # best proven lower bound on the objective
    status: str  # "optimal" (within the gaps) or "time_limit" (feasible, not proven)
    seconds: float  # wall seconds to build and solve the model in the solver


def solve_matrix(
    model: MatrixModel,
    solver: str = "auto",
    *,
    time_limit: float | None = None,
    mip_gap: float = 1e-4,
) -> BackendResult:
    """Solve ``model`` with the requested backend (see module docstring).

    ``time_limit`` is in wall seconds (None: no limit); ``mip_gap`` is the
    relative optimality gap at which the solver may stop.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown ILP solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if solver == "highs":
        return _timed("highs", _solve_highs, model, time_limit, mip_gap)

    gp, reason = _gurobi_for(model)
    level = logging.INFO  # expected situations: no gurobipy, model over the pip license's size
    if reason is None:
        try:
            return _timed("gurobi", functools.partial(_solve_gurobi, gp), model, time_limit, mip_gap)
        except gp.GurobiError as err:
            reason = f"Gurobi failed (error {err.errno}: {err})"
            level = logging.WARNING  # Gurobi looked usable but was not: worth someone's attention
    if solver == "gurobi":
        raise SolverUnavailableError(
            f"solver 'gurobi' was requested but {reason}. "
            "Use solver 'highs', or 'auto' to fall back to HiGHS automatically."
        )
    logger.log(level, "SNIP ILP: falling back to HiGHS because %s", reason)
    return _timed("highs", _solve_highs, model, time_limit, mip_gap)


def _timed(name, backend, model, time_limit, mip_gap) -> BackendResult:
    start = time.perf_counter()
    x, bound, status = backend(model, time_limit, mip_gap)
    return BackendResult(name, x, bound, status, time.perf_counter() - start)


def _import_gurobipy():
    """Import gurobipy (a function of its own so that tests can make it fail)."""
    import gurobipy

    return gurobipy


def gurobi_unavailable() -> str | None:
    """Why Gurobi cannot solve anything here (gurobipy does not import, or no license starts an
    environment), or None; cheap (no model is built), for checking ``--snip-solver gurobi`` at start-up."""
    try:
        gp = _import_gurobipy()
    except ImportError as err:
        return f"gurobipy is not importable ({err})"
    try:
        with gp.Env(empty=True) as env:
            env.setParam("OutputFlag", 0)  # before start(): no license banner
            env.start()
    except gp.GurobiError as err:
        return f"Gurobi has no usable license (error {err.errno}: {err})"
    return None


@functools.cache
def _gurobi_size_limited(gp) -> bool:
    """Whether the installed Gurobi license is size-limited.

    Gurobi exposes no license-type attribute, so this optimises a trivial
    model one variable over the limit (milliseconds) and looks for the
    size-limit error. Cached: the license does not change within a process.
    Raises ``GurobiError`` when there is no usable license at all.
    """
    with gp.Env(empty=True) as env:
        env.setParam("OutputFlag", 0)
        env.start()
        with gp.Model(env=env) as probe:
            probe.addVars(GUROBI_SIZE_LIMIT + 1)
            try:
                probe.optimize()
            except gp.GurobiError as err:
                if err.errno == gp.GRB.Error.SIZE_LIMIT_EXCEEDED:
                    return True
                raise
    return False


def _gurobi_for(model: MatrixModel):
    """``(gurobipy, None)`` when Gurobi should be tried, else ``(module or None, reason)``."""
    try:
        gp = _import_gurobipy()
    except ImportError as err:
        return None, f"gurobipy is not importable ({err})"
    if model.n_vars <= GUROBI_SIZE_LIMIT and model.n_rows <= GUROBI_SIZE_LIMIT:
        return gp, None  # any license admits it; license errors surface at solve time
    try:
        limited = _gurobi_size_limited(gp)
    except gp.GurobiError as err:
        return gp, f"Gurobi has no usable license (error {err.errno}: {err})"
    if limited:
        return gp, (
            f"the model has {model.n_vars} variables and {model.n_rows} constraints, over the "
            f"{GUROBI_SIZE_LIMIT}-variable / {GUROBI_SIZE_LIMIT}-constraint limit of Gurobi's "
            "size-limited license"
        )
    return gp, None


def _solve_gurobi(gp, model: MatrixModel, time_limit: float | None, mip_gap: float):
    GRB = gp.GRB
    with gp.Env(empty=True) as env:
        env.setParam("OutputFlag", 0)  # set before start() so the license banner is silent too
        env.start()
        with gp.Model(env=env) as m:
            m.Params.MIPGap = mip_gap
            m.Params.MIPGapAbs = MIP_ABS_GAP
            m.Params.FeasibilityTol = FEASIBILITY_TOL
            m.Params.IntFeasTol = FEASIBILITY_TOL
            m.Params.OptimalityTol = OPTIMALITY_TOL
            if time_limit is not None:
                m.Params.TimeLimit = time_limit
            x = m.addMVar(model.n_vars, vtype=GRB.BINARY, obj=model.cost)
            xs = x.tolist()
            for cols, vals, is_eq, rhs in model.rows():
                expr = gp.LinExpr(vals.tolist(), [xs[j] for j in cols])
                m.addLConstr(expr, GRB.EQUAL if is_eq else GRB.GREATER_EQUAL, rhs)
            m.optimize()
            if m.Status == GRB.OPTIMAL:
                status = "optimal"
            elif m.Status == GRB.TIME_LIMIT and m.SolCount > 0:
                status = "time_limit"
            elif m.Status in (GRB.INFEASIBLE, GRB.INF_OR_UNBD):
                raise SolverInfeasibleError("Gurobi: the constraints admit no plan")
            else:
                raise SolverError(f"Gurobi stopped without a usable plan (status code {m.Status})")
            return x.X > 0.5, float(m.ObjBound), status


def _solve_highs(model: MatrixModel, time_limit: float | None, mip_gap: float):
    h = highspy.Highs()
    options = {
        "output_flag": False,
        "mip_rel_gap": mip_gap,
        "mip_abs_gap": MIP_ABS_GAP,
        "mip_feasibility_tolerance": FEASIBILITY_TOL,
        "primal_feasibility_tolerance": FEASIBILITY_TOL,
        "dual_feasibility_tolerance": OPTIMALITY_TOL,
        "time_limit": math.inf if time_limit is None else float(time_limit),
    }
    for name, value in options.items():
        # HiGHS reports a bad option through its return status, not an exception.
        if h.setOptionValue(name, value) != highspy.HighsStatus.kOk:
            raise SolverError(f"HiGHS rejected option {name}={value!r}")

    lp = highspy.HighsLp()
    lp.num_col_ = model.n_vars
    lp.num_row_ = model.n_rows
    lp.col_cost_ = model.cost
    lp.col_lower_ = np.zeros(model.n_vars)
    lp.col_upper_ = np.ones(model.n_vars)
    lp.row_lower_ = model.rhs
    lp.row_upper_ = np.where(model.is_equality, model.rhs, math.inf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = model.n_vars
    lp.a_matrix_.num_row_ = model.n_rows
    lp.a_matrix_.start_ = model.row_start
    lp.a_matrix_.index_ = model.col_index
    lp.a_matrix_.value_ = model.value
    lp.integrality_ = [highspy.HighsVarType.kInteger] * model.n_vars
    if h.passModel(lp) != highspy.HighsStatus.kOk:
        raise SolverError("HiGHS rejected the model")
    h.run()

    model_status = h.getModelStatus()
    info = h.getInfo()
    has_solution = info.primal_solution_status == highspy.kSolutionStatusFeasible
    if model_status == highspy.HighsModelStatus.kOptimal:
        status = "optimal"
    elif model_status == highspy.HighsModelStatus.kTimeLimit and has_solution:
        status = "time_limit"
    elif model_status == highspy.HighsModelStatus.kInfeasible:
        raise SolverInfeasibleError("HiGHS: the constraints admit no plan")
    else:
        raise SolverError(f"HiGHS stopped without a usable plan ({h.modelStatusToString(model_status)})")
    x = np.asarray(h.getSolution().col_value) > 0.5
    return x, float(info.mip_dual_bound), status
