"""Stieltjes attention, the pure-PyTorch spec of the ``hfab::stieltjes_*`` ops (README.md has the math).

For each query row i over its allowed keys j: s_ij = scale * q_i . k_j, x_ij = s_ij - max_j s_ij,
lambda_i solves sum_j (lambda_i - x_ij)^(-order) = 1 (Newton, or clamped Halley at order >= 4, on
f^(-1/order) - 1 from a lower bound, ``newton_iter`` steps; newton_iter < 0: -newton_iter steps, then up to
MAX_EXTRA_STEPS more for rows whose last step may have left them short: ``needs_another_step``),
P_ij = (lambda_i - x_ij)^(-order),
out_i = sum_j P_ij v_j / sum_j P_ij.

Compute dtype fp32 (fp64 for fp64 inputs). Queries are processed in chunks so that no tensor is
larger than about ``_CHUNK_ELEMENTS`` scores. Rows that may attend to no key are computed as if
every key were allowed (so nothing is NaN, even under autograd) and their output is set to 0; their
rowmax and lambda are that row's and carry no meaning.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from .._common import allowed_keys, compute_dtype, repeat_kv, sum_kv_groups, zero_empty_rows

_CHUNK_ELEMENTS = 1 << 25


def _row_chunks(batch: int, heads: int, n_q: int, n_k: int) -> list[slice]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * n_k))
    return [slice(a, min(a + rows, n_q)) for a in range(0, n_q, rows)]


def _allowed(q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], causal: bool) -> tuple[Tensor, Tensor]:
    """-> allowed (B, 1, Nq, Nk) with empty rows opened to every key, has_key (B, 1, Nq, 1)."""
    allowed = allowed_keys(q.shape[2], k.shape[2], causal=causal, key_padding_mask=key_padding_mask,
                           batch=q.shape[0], device=q.device)
    has_key = allowed.any(dim=-1, keepdim=True)
    return allowed | ~has_key, has_key


def _scores(q: Tensor, k: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """(B, H, c, D) x (B, H, Nk, D) -> (B, H, c, Nk) scores, -inf at keys that are not allowed."""
    return (torch.matmul(q, k.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))


HALLEY_MIN_ORDER = 4.0  # orders from which the solver takes clamped Halley steps (below: Newton)


STEP_TOL = 0.1  # adaptive solve: a Newton step that moved lambda by more than this (relative) is followed by another
HALLEY_TOL = 3e-4  # adaptive solve: a Halley step whose error estimate (needs_another_step) exceeds this is followed
MAX_EXTRA_STEPS = 2  # at most this many extra steps per row (adaptive solve: newton_iter < 0)


def solve_lambda(x: Tensor, allowed: Tensor, order: float, newton_iter: int) -> Tensor:
    """lambda (...,) with sum_j (lambda - x_j)^(-order) = 1, for x (..., Nk) with max_j x_j = 0.

    x is -inf at keys that are not allowed; every row has an allowed key. The root lies in
    [1, n^(1/order)] (n = allowed keys). Start: ``start_lambda``, a lower bound from n and sum_j x_j alone (the
    largest key apart, Jensen on the others). Each of the ``newton_iter`` steps works on g = f^(-1/order) - 1
    (f^(-1/order) is concave and increasing), with w = f^(1/order):

    - order < 4, Newton: lambda + f (w - 1) / s1 (s1 = sum_j y^(-order-1), y = lambda - x). From a lower bound it
      stays a lower bound and increases monotonically: it cannot overshoot or diverge.
    - order >= 4, Halley clamped to [Newton, n^(1/order)]: lambda + 2 (w - 1) s1 f / den with
      den = 2 s1^2 + (w - 1)(order + 1)(s1^2 - f s2) (s2 = sum_j y^(-order-2)), taken only where den > 0 and it
      goes beyond the Newton iterate (a Newton iterate of a concave increasing g never passes the root; the
      Halley one can, but not past n^(1/order)). Two of these steps reach the accuracy of three to four Newton
      steps at order >= 4 (``python -m benchmarks.stieltjes_solver``); below order 4 they can be worse.

    newton_iter < 0 (the public functions' default, adaptive): -newton_iter steps, then up to ``MAX_EXTRA_STEPS``
    more, each for the rows whose last step may have left them short of the root (``needs_another_step``), the
    others keeping theirs. With the default single Halley step at order 4 the output stays within 4.1e-4 (order 8:
    5.5e-4) of the exact-root output on the solver studies' Gaussian rows, two-cluster rows and SmolLM2's real score
    rows (``csrc/stieltjes/NOTES.md``, "One Halley step and an error estimate"); Gaussian rows like the benchmarks'
    (q, k standard normal, N 4,096 and 16,384) flag none of the rows, real rows about half at order 4 (a tenth at
    order 8).
    """
    n = allowed.sum(dim=-1).to(x.dtype)
    sum_x = torch.where(allowed, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(dim=-1)
    upper = n.pow(1.0 / order)
    lam = start_lambda(n, sum_x, order)
    moved = torch.ones_like(lam, dtype=torch.bool)
    for _ in range(abs(newton_iter)):
        lam, moved = _step_and_moved(x, lam, order, upper)
    for _ in range(MAX_EXTRA_STEPS if newton_iter < 0 else 0):
        if not bool(moved.any()):
            break
        stepped, still = _step_and_moved(x, lam, order, upper)
        lam, moved = torch.where(moved, stepped, lam), moved & still
    return lam


def _step_and_moved(x: Tensor, lam: Tensor, order: float, upper: Tensor) -> tuple[Tensor, Tensor]:
    """solver_step, and whether the row needs another step (``needs_another_step``)."""
    new, newton = solver_iterates(x, lam, order, upper)
    return new, needs_another_step(new, newton, lam)


def needs_another_step(new: Tensor, newton: Tensor, lam: Tensor) -> Tensor:
    """Whether a step from ``lam`` to ``new`` (``newton``: the step's Newton iterate, both clamped >= 1) may leave
    the row short of the root: for a Halley step (new != newton) its error estimate |new - newton| |new - lam| (the
    step's curvature correction times its length: the next term of its cubic convergence) above ``HALLEY_TOL``
    new^2, for a Newton step a move of more than ``STEP_TOL`` new. From a good start one Halley step moves lambda by
    up to ~13% and still lands within ~1e-4 of the root (Gaussian rows at N 4,096), so the step's length alone would
    flag rows that are done."""
    moved = (new - lam).abs()
    return torch.where(new != newton, (new - newton).abs() * moved > HALLEY_TOL * new * new, moved > STEP_TOL * new)


START_STEPS = 6  # Newton steps of start_lambda on its two-term model


def start_lambda(n: Tensor, sum_x: Tensor, order: float) -> Tensor:
    """A lower bound of the root from a row's count n of allowed keys and sum_x = sum_j x_j (x <= 0, max 0): the
    forward kernel's stats sweep gives both.

    x^(-order) is convex, so the n - 1 keys other than the largest give at least (n - 1) (lambda + d)^(-order),
    d = -sum_x / (n - 1) their mean distance below the max (Jensen), and f(lambda) >= h(lambda) =
    lambda^(-order) + (n - 1) (lambda + d)^(-order): the root of h is a lower bound of f's root, and at least
    max(1, n^(1/order) - d') (Jensen on all n keys, d' = -sum_x / n: the previous start). ``START_STEPS`` Newton
    steps on h^(-1/order) - 1 (concave and increasing, as for f) from that start stay below h's root. At order 4
    this start, then two clamped Halley steps, leaves SmolLM2's real score rows at most 2.9e-5 (relative output)
    from the exact root where Jensen's start left 1.1e-3 (``python -m benchmarks.stieltjes_real_rows``).
    """
    rest = torch.clamp_min(n - 1.0, 1.0)
    lam = torch.clamp_min(n.pow(1.0 / order) + sum_x / n, 1.0)
    dist = -sum_x / rest
    for _ in range(START_STEPS):
        lam = _two_term_newton(lam, n - 1.0, dist, order)
    return lam


def _two_term_newton(lam: Tensor, others: Tensor, dist: Tensor, order: float) -> Tensor:
    """One Newton step on h^(-1/order) - 1, h = lambda^(-order) + others (lambda + dist)^(-order)."""
    p_top, p_rest = lam.pow(-order), others * (lam + dist).pow(-order)
    h = p_top + p_rest
    s1 = p_top / lam + p_rest / (lam + dist)
    return lam + h * (h.pow(1.0 / order) - 1.0) / s1


def solver_step(x: Tensor, lam: Tensor, order: float, upper: Tensor) -> Tensor:
    """One step of ``solve_lambda`` from lam (...,): Newton below order 4, clamped Halley from 4 up (with upper =
    n^(1/order), n the allowed keys per row), then clamped to >= 1."""
    return solver_iterates(x, lam, order, upper)[0]


def solver_iterates(x: Tensor, lam: Tensor, order: float, upper: Tensor) -> tuple[Tensor, Tensor]:
    """(``solver_step``'s lambda, the step's Newton iterate), both clamped to >= 1."""
    y = lam[..., None] - x  # inf at keys that are not allowed
    p = y.pow(-order)
    f = p.sum(dim=-1)
    r = p / y
    s1 = r.sum(dim=-1)  # sum_j y^(-order-1) = -f'(lambda) / order
    w = f.pow(1.0 / order)
    newton = lam + f * (w - 1.0) / s1
    if order >= HALLEY_MIN_ORDER:
        s2 = (r / y).sum(dim=-1)
        den = 2.0 * s1 * s1 + (w - 1.0) * (order + 1.0) * (s1 * s1 - f * s2)
        positive = den > 0
        halley = lam + 2.0 * (w - 1.0) * s1 * f / torch.where(positive, den, torch.ones_like(den))  # finite
        beyond = positive & (halley > newton)
        new = torch.where(beyond, torch.maximum(newton, torch.minimum(halley, upper)), newton)
        return torch.clamp_min(new, 1.0), torch.clamp_min(newton, 1.0)
    newton = torch.clamp_min(newton, 1.0)
    return newton, newton


def _forward_chunk(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, order: float,
                   newton_iter: int, backward_state: bool) -> tuple[Tensor, ...]:
    s = _scores(q, k, allowed, scale)
    rowmax = s.amax(dim=-1)
    x = s - rowmax[..., None]
    lam = solve_lambda(x, allowed, order, newton_iter)
    y = lam[..., None] - x
    p = y.pow(-order)
    lsum = p.sum(dim=-1)
    out = torch.matmul(p, v) / lsum[..., None]
    if not backward_state:
        return out, rowmax, lam
    r = p / y
    return out, rowmax, lam, torch.matmul(r, v) / r.sum(dim=-1, keepdim=True), lsum


def stieltjes_forward(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], causal: bool,
                      scale: float, order: float, newton_iter: int, *, recompute: bool = False,
                      backward_state: bool = False) -> tuple[Tensor, ...]:
    """q (B, Hq, Nq, D), k/v (B, Hkv, Nk, D) -> out (B, Hq, Nq, D) in q.dtype, rowmax and lambda
    (B, Hq, Nq) in the compute dtype; with ``backward_state`` also u = sum_j r_ij v_j / sum_j r_ij
    (B, Hq, Nq, D) and sum_j P_ij (B, Hq, Nq), in the compute dtype (0 on rows with no key): the backward's
    delta_i = sum_j dP_ij r_ij / sum_j r_ij is dO_i . u_i. ``recompute``: checkpoint each query chunk
    (autograd through this function keeps only the chunks' inputs, recomputing the rest in the backward)."""
    ct = compute_dtype(q.dtype)
    hq = q.shape[1]
    qf, kf, vf = q.to(ct), repeat_kv(k, hq).to(ct), repeat_kv(v, hq).to(ct)
    allowed, has_key = _allowed(q, k, key_padding_mask, causal)
    chunks = []
    for rows in _row_chunks(q.shape[0], hq, q.shape[2], k.shape[2]):
        args = (qf[:, :, rows], kf, vf, allowed[:, :, rows], scale, order, newton_iter, backward_state)
        chunks.append(checkpoint(_forward_chunk, *args, use_reentrant=False) if recompute else _forward_chunk(*args))
    out, rowmax, lam, *state = (torch.cat(parts, dim=2) for parts in zip(*chunks))
    out = zero_empty_rows(out, has_key).to(q.dtype)
    if not backward_state:
        return out, rowmax, lam
    u, lsum = state
    return out, rowmax, lam, zero_empty_rows(u, has_key), zero_empty_rows(lsum[..., None], has_key)[..., 0]


def stieltjes_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, rowmax: Tensor, lam: Tensor,
                       key_padding_mask: Optional[Tensor], causal: bool, scale: float,
                       order: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradient of the exact-root function (implicit function theorem) at the saved lambda.

    r = (lambda - x)^(-order-1), dP = dO v^T, delta_i = sum_j dP_ij r_ij / sum_j r_ij,
    dS = order * r * (dP - delta), dq = scale dS k, dk = scale dS^T q, dv = (P / rowsum P)^T dO.
    Returns dq (B, Hq, Nq, D), dk, dv (B, Hkv, Nk, D) in the inputs' dtypes.
    """
    ct = compute_dtype(q.dtype)
    hq, hkv = q.shape[1], k.shape[1]
    qf, kf, vf = q.to(ct), repeat_kv(k, hq).to(ct), repeat_kv(v, hq).to(ct)
    allowed, has_key = _allowed(q, k, key_padding_mask, causal)
    do = dout.to(ct) * has_key  # rows with no key output a constant 0
    rowmax, lam = rowmax.to(ct), lam.to(ct)
    dq = torch.empty_like(qf)
    dk = torch.zeros_like(kf)
    dv = torch.zeros_like(vf)
    for rows in _row_chunks(q.shape[0], hq, q.shape[2], k.shape[2]):
        x = _scores(qf[:, :, rows], kf, allowed[:, :, rows], scale) - rowmax[:, :, rows, None]
        y = lam[:, :, rows, None] - x
        p = y.pow(-order)
        r = p / y
        do_c = do[:, :, rows]
        dp = torch.matmul(do_c, vf.transpose(-1, -2))
        delta = (dp * r).sum(dim=-1, keepdim=True) / r.sum(dim=-1, keepdim=True)
        ds = order * r * (dp - delta)
        dq[:, :, rows] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qf[:, :, rows]) * scale
        dv += torch.matmul((p / p.sum(dim=-1, keepdim=True)).transpose(-1, -2), do_c)
    return dq.to(q.dtype), sum_kv_groups(dk, hkv).to(k.dtype), sum_kv_groups(dv, hkv).to(v.dtype)
