"""Initialising a W_Q = I model from a trained standard one (no exact conversion exists).

Three starting points, all with the same parameters as a q-identity model of the source shape:

  drop     remove W_Q and keep everything else (the trivial init, the control).
  basis    `qkvlab.theory.convert.approximate_convert`: the exact recipe of the paper (1-3)
           applied anyway, with the stream basis diag(gamma) W_Q (unit columns) per layer. It is
           exact when W_Q is orthogonal (and fixes 1 under LayerNorm) and the layers share it;
           a trained W_Q is neither, and full skips carry layer l's basis into layer l+1.
  regress  keep the stream basis (the skips and norms stay exact) and move W_Q into the keys,
           head by head. Head h's logits are s q_h k_h^T with q_h = u W_Q^(h) (u: the norm1
           output). With W_Q = I the query can only be u_h, the h-th d_k-slice of u, times any
           d_k x d_k matrix A_h, and A_h folds into the keys exactly:
               s' u_h (k_h A_h^T (s / s'))^T = s (u_h A_h) k_h^T.
           A_h is the least-squares fit of the old query on the slice over real activations,
               A_h = E[u_h^T u_h]^-1 E[u_h^T (u W_Q^(h) + b_Q^(h))],
           which also minimises the expected squared logit error for every key distribution
           (the key-side weight G = E[k^T k] factors out of the normal equations). Where the
           query depended on coordinates outside slice h, that part is lost; the fraction kept
           is reported as the explained query variance.
           Under RoPE the query and key are rotated after their projections, so the fold is
           exact only for an A_h that commutes with every rotation: a scaled 2-D rotation
           [[a, b], [-b, a]] in each rotated channel pair (i, i + d_k/2). A_h is fitted in
           that family (on the pre-rotation query and slice); a general A_h would fit the
           query better but change the logits between positions once folded into the keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import AttentionLayout, Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.theory.convert import approximate_convert
from qkvlab.theory.rope import commuting_basis

INITS: tuple[str, ...] = ("regress", "basis", "drop")
F64 = torch.float64


@dataclass
class Moments:
    """First and second moments of one distinct block's attention input u (its norm1 output)."""

    second: torch.Tensor  # E[u^T u], (d, d) float64
    mean: torch.Tensor  # E[u], (d,) float64
    count: int  # rows (tokens x applications) averaged


@dataclass
class InitInfo:
    """What an init did, for the report."""

    init: str
    note: str
    query_r2: list[float] = field(default_factory=list)  # per distinct block, mean over heads


def check_source(model: GPT, init: str) -> None:
    """Refuse (one line) sources a W_Q = I retrofit does not apply to."""
    cfg = model.cfg
    if init not in INITS:
        raise QkvlabError(f"--init {init!r} is not one of {', '.join(INITS)}")
    if cfg.projection != "baseline":
        raise QkvlabError(f"the source has projection={cfg.projection}: a retrofit starts from a "
                          "standard model with W_Q, W_K, W_V (projection=baseline)")
    if cfg.learned_scale:
        raise QkvlabError("the source learns a logit scale per head (attn_scale = \"learned\"): "
                          "a retrofit starts from a model with one fixed attn_scale")
    if cfg.n_head * cfg.d_head != cfg.n_embd:
        raise QkvlabError(f"W_Q = I needs n_head * head_dim == n_embd, got {cfg.n_head} * "
                          f"{cfg.d_head} != {cfg.n_embd}")
    if init == "regress" and cfg.kv_heads != cfg.n_head:
        raise QkvlabError(f"--init regress folds each query head's fit into its own keys: under "
                          f"grouped-query attention (n_kv_head={cfg.kv_heads} < n_head="
                          f"{cfg.n_head}) heads share keys; use --init drop or basis")


@torch.no_grad()
def attention_moments(model: GPT, batches: Iterable[torch.Tensor]) -> list[Moments]:
    """Moments of every distinct block's attention input over token batches (B, T), float64.

    A shared block (share_layers) pools all of its applications: one W_Q serves them all.
    """
    blocks = list(model.blocks)
    d = model.cfg.n_embd
    sums = [torch.zeros(d, d, dtype=F64) for _ in blocks]
    means = [torch.zeros(d, dtype=F64) for _ in blocks]
    counts = [0 for _ in blocks]

    def hook(i: int):
        def record(module, args):
            u = args[0].detach().reshape(-1, d).to("cpu", F64)
            sums[i].add_(u.T @ u)
            means[i].add_(u.sum(0))
            counts[i] += u.shape[0]
        return record

    handles = [blk.attn.register_forward_pre_hook(hook(i)) for i, blk in enumerate(blocks)]
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for x in batches:
            model(x.to(device))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    if not counts[0]:
        raise QkvlabError("no calibration batches: need at least one to fit the regress init")
    return [Moments(s / n, m / n, n) for s, m, n in zip(sums, means, counts, strict=True)]


def _student_config(model: GPT, attn_scale: float | str):
    return dataclasses.replace(model.cfg, projection="q-identity", attn_scale=attn_scale)


def _source_projections(model: GPT) -> list[Projections]:
    """Every distinct block's W_Q, W_K, W_V and biases, float64 copies on the CPU."""
    return [blk.attn.projections().map(lambda t: t.detach().to("cpu", F64).clone())
            for blk in model.blocks]


def _student_state(model: GPT, student: ModelConfig, parts: list[Projections]
                   ) -> dict[str, torch.Tensor]:
    """The source's state dict (float64) with each block's attention projections replaced by
    `parts` (W_Q and b_Q dropped: the student's query is the identity)."""
    sd = {k: v.detach().to("cpu", F64).clone() for k, v in model.state_dict().items()}
    layout = AttentionLayout.of(student)
    for i, part in enumerate(parts):
        sd.update(layout.state(dataclasses.replace(part, w_q=None, b_q=None),
                               f"blocks.{i}.attn."))
    return sd


def _least_squares_map(s_hh: torch.Tensor, cross: torch.Tensor, lam: float,
                       basis: torch.Tensor | None) -> torch.Tensor:
    """argmin_A E|t - u_h A|^2 + lam |A|^2 (normal equations in the moments), A general or in
    the span of `basis` (m, dk, dk)."""
    dk = s_hh.shape[0]
    if basis is None:
        return torch.linalg.solve(s_hh + lam * torch.eye(dk, dtype=F64), cross)
    gram = torch.einsum("mij,ik,nkj->mn", basis, s_hh, basis) \
        + lam * torch.einsum("mij,nij->mn", basis, basis)
    coef = torch.linalg.solve(gram, torch.einsum("mij,ij->m", basis, cross))
    return torch.einsum("m,mij->ij", coef, basis)


def _fit_heads(model: GPT, moments: list[Moments], parts: list[Projections],
               ratio: float, ridge: float) -> list[float]:
    """Fold each head's least-squares query map A_h into its keys (W_K and b_K of `parts`, in
    place); returns the explained query variance per distinct block (mean over heads)."""
    cfg = model.cfg
    H, dk = cfg.n_head, cfg.d_head
    basis = commuting_basis(dk) if cfg.positions == "rope" else None
    r2_blocks = []
    for mom, part in zip(moments, parts, strict=True):
        w, b = part.w_q, part.b_q  # (d, d) nn.Linear rows per head, float64
        S, m = mom.second, mom.mean
        r2s = []
        for h in range(H):
            sl = slice(h * dk, (h + 1) * dk)
            wq = w[sl].T  # W_Q^(h), paper convention (d, dk)
            bq = b[sl] if b is not None else torch.zeros(dk, dtype=F64)
            s_hh = S[sl, sl]
            # E[u_h^T t] for the target t = u W_Q^(h) + b_Q^(h)
            cross = S[sl] @ wq + torch.outer(m[sl], bq)
            lam = ridge * float(torch.diagonal(s_hh).mean().clamp_min(1e-30))
            A = _least_squares_map(s_hh, cross, lam, basis)  # (dk, dk)
            # explained variance of the query (second moments, no intercept: as the logits see)
            tt = wq.T @ S @ wq + wq.T @ torch.outer(m, bq) + torch.outer(bq, m) @ wq \
                + torch.outer(bq, bq)
            resid = torch.trace(tt) - 2 * torch.trace(A.T @ cross) + torch.trace(A.T @ s_hh @ A)
            total = float(torch.trace(tt))
            r2s.append(1.0 - float(resid) / total if total > 0 else 0.0)
            # head h's key rows (one key head per query head: check_source saw to it)
            part.w_k[sl] = ratio * (A @ part.w_k[sl])
            if part.b_k is not None:
                part.b_k[sl] = ratio * (A @ part.b_k[sl])
        r2_blocks.append(sum(r2s) / len(r2s))
    return r2_blocks


def build_student(model: GPT, init: str = "regress", moments: list[Moments] | None = None,
                  *, ridge: float = 1e-8) -> tuple[GPT, InitInfo]:
    """A q-identity GPT initialised from the baseline `model` by `init` (see the module doc).

    `regress` needs `moments` (from `attention_moments` on training batches); `ridge` (relative
    to the slice's mean second moment) only guards against a singular slice. The student has
    the source's dtype and device and the paper's halved scale (except `basis`, which keeps the
    source's scale, as the theory's conversion does).
    """
    check_source(model, init)
    ref = next(model.parameters())
    if init == "basis":
        student, report = approximate_convert(model, "q-identity")
        fails = ", ".join(h.name.split(" (")[0] for h in report.violations) or "none"
        info = InitInfo(init, f"theory's best available conversion (failing hypotheses: "
                              f"{fails}; max condition number {report.max_condition:.3g})")
        return student.to(ref.device).train(model.training), info

    cfg = _student_config(model, "paper")
    parts = _source_projections(model)
    if init == "drop":
        info = InitInfo(init, "W_Q removed, everything else kept")
    else:
        if moments is None or len(moments) != len(model.blocks):
            raise QkvlabError("--init regress needs attention moments for every block")
        ratio = model.cfg.scale / cfg.scale  # s / s': the halved scale moves into the keys
        r2 = _fit_heads(model, moments, parts, ratio, ridge)
        rope = (", each map commuting with RoPE's rotations" if model.cfg.positions == "rope"
                else "")
        info = InitInfo(init, f"per-head least-squares query on its own slice folded into W_K"
                              f"{rope} ({moments[0].count:,} calibration tokens)", r2)
    sd = _student_state(model, cfg, parts)
    student = GPT(cfg).to(dtype=ref.dtype)
    student.load_state_dict({k: v.to(ref.dtype) for k, v in sd.items()}, strict=True)
    return student.to(ref.device).train(model.training), info
