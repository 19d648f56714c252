"""Can a ReLU MLP absorb its own skip connection? (docs/paper.md section 4)

Column convention here: x in R^d, W1 of shape (m, d), W2 of shape (d, m), and

    with skip:  f(x) = x + W2 relu(W1 x)        skip-free:  g(x) = W2' relu(W1' x)

The mechanism is relu(t) - relu(-t) = t. If an index set S of hidden units has
W2[:, S] W1[S, :] = -I, then

    sum_{i in S} w2_i relu(w1_i . x) = -x + sum_{i in S} w2_i relu(-w1_i . x),

so flipping the sign of W1's rows in S gives a skip-free MLP of the SAME width equal to f. For
generic weights no such S exists and the classes are disjoint; with width m + 2d the identity is
always available (relu(x) - relu(-x)).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from qkvlab.errors import QkvlabError
from qkvlab.theory.common import generator

F64 = torch.float64
IndexSet = tuple[int, ...]


def _as_weights(W1, W2) -> tuple[torch.Tensor, torch.Tensor]:
    W1 = torch.as_tensor(W1).to(F64)
    W2 = torch.as_tensor(W2).to(F64)
    if W1.ndim != 2 or W2.ndim != 2:
        raise QkvlabError(f"W1 and W2 must be matrices, got shapes {tuple(W1.shape)} and "
                          f"{tuple(W2.shape)}")
    m, d = W1.shape
    if W2.shape != (d, m):
        raise QkvlabError(f"shape mismatch: W1 is {m} x {d} (m x d), so W2 must be {d} x {m} "
                          f"(d x m), got {tuple(W2.shape)[0]} x {tuple(W2.shape)[1]}")
    if not (torch.isfinite(W1).all() and torch.isfinite(W2).all()):
        raise QkvlabError("W1 and W2 must be finite")
    return W1, W2


def mlp(W1, W2, x: torch.Tensor, *, skip: bool) -> torch.Tensor:
    """x (n, d) -> (x +) relu(x W1^T) W2^T, the row-batched form of (x +) W2 relu(W1 x)."""
    W1, W2 = _as_weights(W1, W2)
    y = torch.relu(x @ W1.T) @ W2.T
    return x + y if skip else y


def skip_defect(W1, W2, S: IndexSet) -> float:
    """max |W2[:, S] W1[S, :] + I|: 0 exactly when S absorbs the skip."""
    W1, W2 = _as_weights(W1, W2)
    idx = list(S)
    d = W1.shape[1]
    prod = W2[:, idx] @ W1[idx, :] if idx else torch.zeros(d, d, dtype=F64)
    return float((prod + torch.eye(d, dtype=F64)).abs().max())


def absorbable(W1, W2, tol: float = 1e-9, *, max_free: int = 16) -> IndexSet | None:
    """An index set S with W2[:, S] W1[S, :] = -I (to `tol`), or None when there is none.

    A subset-sum over the rank-one matrices R_i = w2_i w1_i^T: find c in {0, 1}^m with
    sum_i c_i R_i = -I. Units with R_i = 0 never matter and are left out. Among the others a
    maximal linearly independent set is determined by the rest: every 0/1 choice of the k
    dependent ("free") units fixes them by least squares, so the search is complete and costs
    2^k solves (k = 0 for m <= d^2 generic units). The smallest S found is returned.
    """
    W1, W2 = _as_weights(W1, W2)
    m, d = W1.shape
    R = torch.einsum("im,mj->mij", W2, W1).reshape(m, d * d).T  # column i = vec(w2_i w1_i^T)
    target = -torch.eye(d, dtype=F64).reshape(-1)
    scale = float(R.abs().max()) if m else 0.0
    live = [i for i in range(m) if float(R[:, i].abs().max()) > 1e-14 * max(scale, 1e-300)]
    # Greedy rank-revealing pass (modified Gram-Schmidt) splits live units into basis and free.
    basis, free, q = [], [], []
    for i in live:
        v = R[:, i].clone()
        for u in q:
            v -= (u @ v) * u
        if float(v.norm()) > 1e-9 * float(R[:, i].norm()):
            q.append(v / v.norm())
            basis.append(i)
        else:
            free.append(i)
    if len(free) > max_free:
        raise QkvlabError(
            f"the index-set search would enumerate 2^{len(free)} choices ({len(free)} hidden "
            f"units are linear combinations of others); raise max_free or reduce m")
    if len(basis) < d:  # rank of sum_{S} R_i is at most |S|; -I needs d
        return None
    choices = list(itertools.product((0.0, 1.0), repeat=len(free)))  # [()] when k = 0
    Z = torch.tensor(choices, dtype=F64).reshape(len(choices), len(free)).T  # (k, 2^k)
    rhs = target[:, None] - R[:, free] @ Z
    sol = torch.linalg.lstsq(R[:, basis], rhs).solution  # (|basis|, 2^k)
    best: IndexSet | None = None
    for j in range(Z.shape[1]):
        c = sol[:, j]
        rounded = c.round()
        if float((c - rounded).abs().max()) > 1e-6:
            continue
        if not bool(((rounded == 0) | (rounded == 1)).all()):
            continue
        S = tuple(sorted([basis[t] for t in range(len(basis)) if rounded[t] == 1]
                         + [free[t] for t in range(len(free)) if Z[t, j] == 1]))
        if skip_defect(W1, W2, S) <= tol and (best is None or len(S) < len(best)):
            best = S
    return best


def absorb(W1, W2, S: IndexSet | None = None, tol: float = 1e-9,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A skip-free MLP (W1', W2') of the same width with W2' relu(W1' x) = x + W2 relu(W1 x).

    W1' is W1 with the rows in S negated and W2' = W2. Raises QkvlabError when no S exists
    (the generic case) or when the given S does not satisfy W2[:, S] W1[S, :] = -I.
    """
    W1, W2 = _as_weights(W1, W2)
    if S is None:
        S = absorbable(W1, W2, tol)
        if S is None:
            raise QkvlabError(
                "section 4: no index set S of hidden units has W2[:, S] W1[S, :] = -I, so no "
                "skip-free MLP of the same width represents x + W2 relu(W1 x); use widen_exact "
                "(width m + 2d)")
    else:
        S = tuple(int(i) for i in S)
        if any(not 0 <= i < W1.shape[0] for i in S) or len(set(S)) != len(S):
            raise QkvlabError(f"index set {S} is not a set of distinct hidden units "
                              f"0..{W1.shape[0] - 1}")
        defect = skip_defect(W1, W2, S)
        if defect > tol:
            raise QkvlabError(f"section 4: index set {S} does not absorb the skip: "
                              f"max |W2[:, S] W1[S, :] + I| = {defect:.3g} > {tol:.0e}")
    W1n = W1.clone()
    W1n[list(S)] *= -1.0
    return W1n, W2.clone()


def widen_exact(W1, W2) -> tuple[torch.Tensor, torch.Tensor]:
    """Width m + 2d skip-free MLP equal to x + W2 relu(W1 x), always: x = relu(x) - relu(-x)."""
    W1, W2 = _as_weights(W1, W2)
    eye = torch.eye(W1.shape[1], dtype=F64)
    return torch.cat([W1, eye, -eye], dim=0), torch.cat([W2, eye, -eye], dim=1)


def positive_example(d: int, m: int, seed: int, k: int | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, IndexSet]:
    """Random (W1, W2) built to be absorbable through a hidden index set S of size k (d <= k <= m).

    W2[:, S] = -pinv(W1[S, :]) makes W2[:, S] W1[S, :] = -I; the other units are generic and
    the units are shuffled so S is not simply the first k.
    """
    k = d if k is None else k
    if not d <= k <= m:
        raise QkvlabError(f"need d <= k <= m for an absorbable example, got d={d}, k={k}, m={m}")
    g = generator(seed)
    W1 = torch.randn(m, d, generator=g, dtype=F64)
    W2 = torch.randn(d, m, generator=g, dtype=F64) / math.sqrt(m)
    W2[:, :k] = -torch.linalg.pinv(W1[:k])
    perm = torch.randperm(m, generator=g)
    inv = torch.argsort(perm)
    S = tuple(sorted(int(inv[i]) for i in range(k)))
    return W1[perm], W2[:, perm], S


def generic_example(d: int, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian (W1, W2): with probability 1 not absorbable."""
    g = generator(seed)
    return (torch.randn(m, d, generator=g, dtype=F64),
            torch.randn(d, m, generator=g, dtype=F64) / math.sqrt(m))


@dataclass
class FitResult:
    """Best skip-free fit found for a function with a skip, on points of the unit sphere."""

    width: int
    rel_error: float  # ||g - f||_F / ||f||_F over the sample
    max_abs_error: float
    W1: torch.Tensor
    W2: torch.Tensor


def _lstsq_out(W1: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Optimal W2 for fixed W1 (closed form): min ||relu(x W1^T) W2^T - y||."""
    h = torch.relu(x @ W1.T)
    return torch.linalg.lstsq(h, y).solution.T


def same_width_fit(W1, W2, *, n: int = 2048, steps: int = 400, restarts: int = 3,
                   seed: int = 0, width: int | None = None) -> FitResult:
    """Fit a skip-free MLP of width m (or `width`) to x + W2 relu(W1 x); return the best fit.

    Both functions are positively homogeneous, so points on the unit sphere suffice. Starts:
    the given weights (the skip-free part of f), the same with the best-looking sign flips, and
    random ones; each is trained with full-batch Adam in float64 and finished with the exact
    least-squares output layer. A residual far above rounding error (~1e-12) is the measured
    face of the section 4 obstruction; it is an upper bound on the true best error.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny problem: thread hand-offs cost more than the math
    try:
        return _fit(W1, W2, n=n, steps=steps, restarts=restarts, seed=seed, width=width)
    finally:
        torch.set_num_threads(threads)


def _fit(W1, W2, *, n: int, steps: int, restarts: int, seed: int,
         width: int | None) -> FitResult:
    W1, W2 = _as_weights(W1, W2)
    m, d = W1.shape
    width = m if width is None else width
    g = generator(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    x = x / x.norm(dim=1, keepdim=True)
    y = mlp(W1, W2, x, skip=True)
    starts = []
    if width == m:
        starts.append(W1.clone())
        # flip the units whose rank-one term is most anti-aligned with the identity
        align = torch.einsum("im,mi->m", W2, W1)
        flipped = W1.clone()
        flipped[align < 0] *= -1.0
        starts.append(flipped)
    while len(starts) < max(restarts, 1):
        starts.append(torch.randn(width, d, generator=g, dtype=F64))
    best: FitResult | None = None
    for a0 in starts:
        a = a0.clone().requires_grad_(True)
        b = _lstsq_out(a0, x, y).clone().requires_grad_(True)
        opt = torch.optim.Adam([a, b], lr=1e-2)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
        for _ in range(steps):
            opt.zero_grad()
            loss = ((torch.relu(x @ a.T) @ b.T - y) ** 2).mean()
            loss.backward()
            opt.step()
            sched.step()
        with torch.no_grad():
            a_fit = a.detach()
            b_fit = _lstsq_out(a_fit, x, y)
            err = torch.relu(x @ a_fit.T) @ b_fit.T - y
            rel = float(err.norm() / y.norm())
            if best is None or rel < best.rel_error:
                best = FitResult(width, rel, float(err.abs().max()), a_fit, b_fit)
    assert best is not None
    return best
