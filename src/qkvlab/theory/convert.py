"""Exact W_Q (or W_K, W_V) elimination, docs/paper.md sections 1-3.

Convention: the paper writes rows as tokens, Q = X W_Q with W_Q of shape (d_in, d_out);
`nn.Linear` stores weight = W^T of shape (out, in). Internally everything below is in the
paper's convention and float64; `_paper` / `_linear` translate.

The recipe. Let X_l be the input of layer l and W_X the projection to remove (X in {Q, K, V}).
The converted model carries the residual stream in a per-layer basis B_l: X_l' = X_l B_l.
  * attention input u' = u W_X (so the removed projection is the identity) and the kept ones
    become W_X^-1 W_P (section 1, the invariance lemma with T = W_X);
  * whatever feeds the stream multiplies by B on the right (embeddings, W_O when a skip adds the
    attention output to the stream, W_2 with the NEXT layer's basis);
  * whatever reads the stream, other than attention, multiplies by B^-1 on the left (W_1, an
    untied head).
Without normalization B_l = W_X of layer l. With a norm, B_l is chosen so that the norm's gain
can carry the rest (B_l diag(gamma') = diag(gamma) W_X, section 3), which only helps when B_l is
orthogonal (and fixes the all-ones direction for LayerNorm).

`convert` checks the hypotheses of the theorem that applies and refuses (QkvlabError, one line,
naming the hypothesis and the measured defect) when one fails. `approximate_convert` applies the
same recipe regardless and reports which hypotheses fail and by how much; the output error it
causes is measured in `qkvlab.theory.limits`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from qkvlab.errors import QkvlabError
from qkvlab.model.attention_layout import AttentionLayout, Projections
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.theory.common import param_count

TARGETS: tuple[str, ...] = ("q-identity", "k-identity", "v-identity")
F64 = torch.float64


@dataclass
class Hypothesis:
    """One hypothesis of the applicable theorem and how far the model is from satisfying it."""

    name: str
    defect: float  # 0 when it holds exactly; compared with tol
    tol: float
    message: str  # the refusal text when it does not hold

    @property
    def holds(self) -> bool:
        return math.isfinite(self.defect) and self.defect <= self.tol


@dataclass
class ConversionReport:
    """What a conversion did: theorem, parameter counts, conditioning, checked hypotheses."""

    to: str
    theorem: str
    params_before: int = 0
    params_after: int = 0
    conditions: dict[str, float] = field(default_factory=dict)  # basis name -> cond_2
    hypotheses: list[Hypothesis] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def params_saved(self) -> int:
        return self.params_before - self.params_after

    @property
    def max_condition(self) -> float:
        return max(self.conditions.values(), default=1.0)

    @property
    def exact(self) -> bool:
        """True when every hypothesis holds: the converted model computes the same function."""
        return all(h.holds for h in self.hypotheses)

    @property
    def violations(self) -> list[Hypothesis]:
        return [h for h in self.hypotheses if not h.holds]

    def summary(self) -> str:
        lines = [
            f"theorem: {self.theorem}",
            f"parameters: {self.params_before:,} -> {self.params_after:,} "
            f"(saved {self.params_saved:,})",
            f"max condition number: {self.max_condition:.3g}",
        ]
        lines += [f"hypothesis {'holds' if h.holds else 'FAILS'}: {h.name} "
                  f"(defect {h.defect:.2e}, tol {h.tol:.0e})" for h in self.hypotheses]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---- helpers ----------------------------------------------------------------------------------

def _paper(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear weight (out, in) -> the paper's W (in, out), float64."""
    return weight.detach().to("cpu", F64).T.clone()


def _linear(w: torch.Tensor) -> torch.Tensor:
    """Paper W (in, out) -> nn.Linear weight (out, in)."""
    return w.T.contiguous()


def _cond(m: torch.Tensor) -> float:
    try:
        c = float(torch.linalg.cond(m))
    except RuntimeError:  # LAPACK failure on a pathological matrix: treat as singular
        return math.inf
    return c if math.isfinite(c) else math.inf


def _orthogonality_defect(b: torch.Tensor, kind: str) -> float:
    """How far b is from commuting with the norm: ||b^T b - I||_max, plus, for LayerNorm,
    how far b and b^T are from mapping 1 into span(1) (so that b commutes with centring)."""
    d = b.shape[0]
    eye = torch.eye(d, dtype=F64)
    defect = float((b.T @ b - eye).abs().max())
    if kind == "layernorm":
        one = torch.ones(d, dtype=F64) / math.sqrt(d)
        for v in (b @ one, b.T @ one):
            defect = max(defect, float((v - (v @ one) * one).norm()))
    return defect


def _check_source(model: GPT, to: str) -> str:
    """Refuse sources and targets outside every theorem; returns 'q', 'k' or 'v'."""
    if not isinstance(model, GPT):
        raise QkvlabError(f"convert expects a qkvlab GPT, got {type(model).__name__}")
    cfg = model.cfg
    bad = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
    if bad:
        raise QkvlabError(f"the source model has non-finite weights ({', '.join(bad[:3])}): "
                          "nothing to convert")
    if to not in TARGETS:
        raise QkvlabError(f"cannot convert to {to!r}: choose one of {', '.join(TARGETS)}")
    if cfg.projection != "baseline":
        raise QkvlabError(
            f"the source model has projection={cfg.projection}: a conversion starts from a "
            "standard model with W_Q, W_K and W_V (projection=baseline)")
    if cfg.learned_scale:
        raise QkvlabError("the source model learns a logit scale per head (attn_scale = "
                          "\"learned\"): the theorems assume one scale for all heads; convert "
                          "a model trained with a fixed attn_scale")
    which = to[0]
    W = f"W_{which.upper()}"
    d, q_dim = cfg.n_embd, cfg.n_head * cfg.d_head
    if q_dim != d:
        raise QkvlabError(
            f"section 1 needs a square, invertible {W}: n_head * head_dim = {q_dim} != n_embd = "
            f"{d}, so {W} is {d} x {q_dim}")
    if which in "kv" and cfg.kv_heads != cfg.n_head:
        raise QkvlabError(
            f"section 1: under grouped-query attention (n_kv_head={cfg.kv_heads} < "
            f"n_head={cfg.n_head}) {W} is d x {cfg.kv_heads * cfg.d_head}, not square; only "
            "W_Q can become the identity (use --to q-identity)")
    return which


@dataclass
class _Block:
    """One distinct block's weights in the paper's convention (float64), None where absent."""

    P: dict[str, torch.Tensor]
    b: dict[str, torch.Tensor | None]
    WO: torch.Tensor
    bO: torch.Tensor | None
    W1: torch.Tensor
    b1: torch.Tensor | None
    W2: torch.Tensor
    b2: torch.Tensor | None
    g1: torch.Tensor | None
    beta1: torch.Tensor | None
    g2: torch.Tensor | None
    beta2: torch.Tensor | None


def _read_blocks(model: GPT, sd: dict[str, torch.Tensor]) -> list[_Block]:
    out = []
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}."
        parts = block.attn.projections()
        P = {n: _paper(parts.weight(n)) for n in "qkv"}  # the source is a baseline: all three
        b = {n: None if parts.bias(n) is None else parts.bias(n).detach().to("cpu", F64)
             for n in "qkv"}

        def get(key: str, p: str = p) -> torch.Tensor | None:
            t = sd.get(p + key)
            return t.detach().to("cpu", F64).clone() if t is not None else None

        out.append(_Block(
            P=P, b=b,
            WO=_paper(sd[p + "attn.out_proj.weight"]), bO=get("attn.out_proj.bias"),
            W1=_paper(sd[p + "mlp.fc_in.weight"]), b1=get("mlp.fc_in.bias"),
            W2=_paper(sd[p + "mlp.fc_out.weight"]), b2=get("mlp.fc_out.bias"),
            g1=get("norm1.weight"), beta1=get("norm1.bias"),
            g2=get("norm2.weight"), beta2=get("norm2.bias"),
        ))
    return out


# ---- the plan: bases, hypotheses, refusals -----------------------------------------------------

@dataclass
class _Plan:
    which: str
    blocks: list[_Block]
    A: list[torch.Tensor]  # per distinct block: W_X (the attention input basis)
    B: list[torch.Tensor]  # per distinct block: stream basis at the block input
    g1_new: list[torch.Tensor | None]  # per distinct block: norm1 gain after conversion
    B_next: list[torch.Tensor]  # per distinct block: basis its W_2 writes into
    B_final: torch.Tensor  # stream basis entering norm_f / the head
    free_end: bool  # the last layer's W_2 can write any basis (no skip around the last MLP)
    report: ConversionReport


def _theorem(model: GPT, free_end: bool) -> str:
    cfg = model.cfg
    L, r = cfg.n_layer, cfg.residual
    one_app = L == 1
    if one_app:
        text = {"none": "2.1 single layer, no skip (embeddings absorb W_X)",
                "attention": "2.1 single layer, skip around attention (W_O W_X, W_X^-1 W_1)",
                "full": "2.1 single layer, skips around attention and MLP (W_O, W_2 times W_X; "
                        "head absorbs W_X^-1)"}[r]
    elif r == "full":
        text = ("2.3 L layers, full skips, shared weights (one basis for the whole stream)"
                if cfg.share_layers else
                "2.3 L layers, full skips, every layer with the same W_X (one basis)")
    elif cfg.share_layers:
        text = f"2.3 pattern: shared weights, residual={r}, one basis for the whole stream"
    elif r == "attention":
        text = "2.2 L layers, skip around attention only (W_2 of layer l carries T_{l+1})"
    else:
        text = "2.2 pattern: L layers without skips (W_2 of layer l carries T_{l+1})"
    if cfg.tie_embeddings:
        text += (" + tied head: last W_2 carries T_1^-T" if free_end else
                 " + 2.4 tied embeddings with orthogonal T")
    if cfg.norm != "none":
        text = f"section 3 ({cfg.norm}, orthogonal special case) on {text}"
    return text


def _plan(model: GPT, to: str, *, cond_limit: float, tol: float) -> _Plan:
    which = _check_source(model, to)
    cfg = model.cfg
    W = f"W_{which.upper()}"
    sd = model.state_dict()
    blocks = _read_blocks(model, sd)
    norm = cfg.norm != "none"
    report = ConversionReport(to=to, theorem="")
    _check_biases(cfg, blocks, which, report)

    # Bases. A_i = W_X (attention input basis); B_i = stream basis.
    A, B, g1_new = [], [], []
    for i, blk in enumerate(blocks):
        a = blk.P[which]
        c = _cond(a)
        report.conditions[f"{W} layer {i}"] = c
        if not c <= cond_limit:
            # beyond 1/eps(float64) the matrix is singular to working precision
            what = "singular" if c > 1e15 else "ill-conditioned"
            raise QkvlabError(
                f"section 1 needs an invertible {W}: layer {i}'s {W} is {what} (condition number "
                f"{c:.3g} > limit {cond_limit:.3g}); its inverse would amplify rounding errors")
        A.append(a)
        bi, gi = _norm_basis(i, blk, a, W, cond_limit, report) if norm else (a, None)
        B.append(bi)
        g1_new.append(gi)

    free_end, B_final, B_next = _end_bases(cfg, B)
    # ---- hypotheses (exact = all hold); the first failing one is the refusal ----------------
    hyps = report.hypotheses
    if norm:
        hyps.append(_norm_hypothesis(cfg.norm, B, B_final, W, tol))
    L = cfg.n_layer
    if cfg.residual == "full" and not cfg.share_layers and L > 1:
        hyps.append(_skip_hypothesis(B, L, tol))
    if cfg.tie_embeddings:
        hyps.append(_tied_head_hypothesis(sd, norm, B[0], B_final, free_end, W, tol))

    report.theorem = _theorem(model, free_end)
    if cfg.positions == "learned":
        report.notes.append("learned positions: P' = P T_1, like the token table")
    elif cfg.positions == "rope":
        report.notes.append("RoPE rotates q and k after the projections: X' W' = X W, unchanged")
    if norm:
        report.notes.append("norm2 and final-norm gains folded into W_1 and the head")
    return _Plan(which, blocks, A, B, g1_new, B_next, B_final, free_end, report)


def _check_biases(cfg: ModelConfig, blocks: list[_Block], which: str,
                  report: ConversionReport) -> None:
    """Decide per target whether the identity can reproduce the biases (never silently drop)."""
    for i, blk in enumerate(blocks):
        bx = blk.b[which]
        if bx is None or not bool(bx.abs().max() > 0):
            continue
        if which == "q":
            raise QkvlabError(
                f"layer {i} has a nonzero query bias b_Q (max |b_Q| = {float(bx.abs().max()):.3g}):"
                " the identity query X' = X W_Q cannot reproduce X W_Q + b_Q; train with "
                "bias=false or zero b_Q")
        if which == "k" and cfg.positions == "rope":
            raise QkvlabError(
                f"layer {i} has a nonzero key bias b_K under RoPE: the rotated bias varies with "
                "the key position, so it cannot be dropped; train with bias=false")
    if which == "k" and any(blk.b["k"] is not None for blk in blocks):
        report.notes.append("b_K dropped: it adds a per-query constant to the logits, which "
                            "softmax ignores")
    if which == "v" and any(blk.b["v"] is not None for blk in blocks):
        report.notes.append("b_V folded into b_O: every attention row sums to 1, so A(V + 1 b_V)"
                            " W_O = A V W_O + b_V W_O")


def _norm_basis(i: int, blk: _Block, a: torch.Tensor, W: str, cond_limit: float,
                report: ConversionReport) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's stream basis under a norm, and the norm1 gain that carries the rest."""
    # B diag(gamma') = diag(gamma) W_X with unit columns in B: exact when the columns of
    # diag(gamma) W_X are orthogonal, the only case section 3 allows.
    ga = blk.g1[:, None] * a
    cn = ga.norm(dim=0)
    if not bool((cn > 0).all()):
        raise QkvlabError(f"layer {i}: diag(gamma) {W} has a zero column (a zero norm1 "
                          "gain): no basis can carry it")
    bi = ga / cn
    cb = _cond(bi)
    report.conditions[f"stream basis layer {i}"] = cb
    if not cb <= cond_limit:
        raise QkvlabError(
            f"section 3: layer {i}'s stream basis diag(gamma) {W} diag(1/|col|) is "
            f"ill-conditioned (condition number {cb:.3g} > limit {cond_limit:.3g})")
    return bi, cn


def _end_bases(cfg: ModelConfig, B: list[torch.Tensor]
               ) -> tuple[bool, torch.Tensor, list[torch.Tensor]]:
    """(free_end, the basis entering the final norm / head, the basis each W_2 writes into)."""
    eye = torch.eye(cfg.n_embd, dtype=F64)
    L = cfg.n_layer
    shared_multi = cfg.share_layers and L > 1
    free_end = cfg.residual != "full" and not shared_multi
    B1 = B[0]
    if not free_end:
        B_final = B[-1]  # the skip (or the shared W_2) keeps the stream in the last basis
    elif cfg.tie_embeddings:
        B_final = torch.linalg.inv(B1).T  # head = E' = E B_1 reads z B_F: needs B_F B_1^T = I
    else:
        B_final = eye
    if shared_multi:
        B_next = [B[0]]
    else:
        B_next = B[1:] + [B_final]
    return free_end, B_final, B_next


def _norm_hypothesis(kind: str, B: list[torch.Tensor], B_final: torch.Tensor, W: str,
                     tol: float) -> Hypothesis:
    """Section 3: the norm commutes with every basis only when it is orthogonal (and, for
    LayerNorm, keeps the all-ones direction)."""
    targets = [(f"norm1 of layer {i}", B[i]) for i in range(len(B))]
    targets.append(("final norm", B_final))
    worst, where = 0.0, ""
    for name, b in targets:
        dfct = _orthogonality_defect(b, kind)
        if dfct > worst:
            worst, where = dfct, name
    need = ("orthogonal and keeps the all-ones direction" if kind == "layernorm"
            else "orthogonal")
    return Hypothesis(
        f"{kind} commutes with the basis change (T {need})", worst, tol,
        f"section 3: normalization obstructs an exact conversion unless {W} is orthogonal "
        f"(RMSNorm) or orthogonal and keeps the all-ones direction (LayerNorm), with gains "
        f"T diag(gamma') = diag(gamma) {W}; this {kind} model's basis at {where} misses by "
        f"{worst:.3g}. Use approximate_convert to measure the error, or train the reduced "
        "model from scratch")


def _skip_hypothesis(B: list[torch.Tensor], L: int, tol: float) -> Hypothesis:
    """Section 2.3: full skips without shared weights need the same basis in every layer."""
    defect = max(float((B[i] - B[i + 1]).abs().max() / B[i].abs().max().clamp_min(1e-300))
                 for i in range(L - 1))
    return Hypothesis(
        "full skips need one basis for the whole stream (shared weights)", defect, tol,
        f"section 2.3: full skips (around attention and MLP) without shared weights: layer "
        f"l's basis would have to pass the skip into layer l+1, which an MLP with a skip "
        f"cannot absorb (section 4); relative |T_l - T_l+1| = {defect:.3g}. Use "
        "share_layers=true or residual='attention', or approximate_convert to measure the "
        "error")


def _tied_head_hypothesis(sd: dict[str, torch.Tensor], norm: bool, B1: torch.Tensor,
                          B_final: torch.Tensor, free_end: bool, W: str, tol: float
                          ) -> Hypothesis:
    """Section 2.4: a tied head reads the stream through the token table's basis."""
    eye = torch.eye(B1.shape[0], dtype=F64)
    if norm:
        gf = sd["norm_f.weight"].detach().to("cpu", F64)
        G = torch.linalg.solve(B_final, torch.diag(gf)) @ torch.linalg.inv(B1).T
        off = G - torch.diag(torch.diagonal(G))
        defect = float(off.abs().max() / G.abs().max().clamp_min(1e-300))
        name = "tied head: T_F^-1 diag(gamma_f) T_1^-T is diagonal (a new final gain)"
    else:
        defect = 0.0 if free_end else float((B_final @ B1.T - eye).abs().max())
        name = "tied head: the stream's last basis T_F satisfies T_F T_1^T = I"
    return Hypothesis(
        name, defect, tol,
        f"section 2.4: tied embeddings with a residual path to the head need T^-1 = T^T "
        f"(an orthogonal {W}); here the defect is {defect:.3g}. Untie the head "
        "(tie_embeddings=false), use residual='attention', or approximate_convert")


# ---- applying the plan -------------------------------------------------------------------------

def _apply(model: GPT, plan: _Plan, to: str, dtype: torch.dtype | None) -> GPT:
    cfg = model.cfg
    new_cfg = dataclasses.replace(cfg, projection=to, attn_scale=cfg.scale)
    sd = {k: v.detach().to("cpu", F64).clone() for k, v in model.state_dict().items()}
    layout = AttentionLayout.of(new_cfg)
    for i, blk in enumerate(plan.blocks):
        _apply_block(sd, cfg, plan, i, blk, layout)
    _apply_ends(sd, cfg, plan)
    ref = next(model.parameters())
    target = ref.dtype if dtype is None else dtype
    # Cast before loading: load_state_dict copies into the existing (float32) tensors.
    new = GPT(new_cfg).to(dtype=target)
    new.load_state_dict({k: v.to(target) for k, v in sd.items()}, strict=True)
    new.to(device=ref.device)
    new.train(model.training)
    return new


def _apply_block(sd: dict[str, torch.Tensor], cfg: ModelConfig, plan: _Plan, i: int,
                 blk: _Block, layout: AttentionLayout) -> None:
    """Block i's weights in the new basis (float64, in place in `sd`); `layout` is the
    converted attention's."""
    p, which = f"blocks.{i}.", plan.which
    a, b_in, b_next = plan.A[i], plan.B[i], plan.B_next[i]
    eye = torch.eye(cfg.n_embd, dtype=F64)
    kept = [n for n in "qkv" if n != which]
    # Section 1: u' = u W_X, so each kept projection becomes W_X^-1 W_P.
    kept_parts = {f"w_{n}": _linear(torch.linalg.solve(a, blk.P[n])) for n in kept}
    if blk.b["q"] is not None:
        kept_parts |= {f"b_{n}": blk.b[n] for n in kept}
    sd.update(layout.state(Projections(**kept_parts), p + "attn."))
    b_o = blk.bO
    if which == "v" and blk.b["v"] is not None:
        b_o = b_o + blk.b["v"] @ blk.WO
    # The attention output joins the stream (basis b_in) when a skip adds it there.
    o = b_in if cfg.residual in ("full", "attention") else eye
    sd[p + "attn.out_proj.weight"] = _linear(blk.WO @ o)
    if b_o is not None:
        sd[p + "attn.out_proj.bias"] = b_o @ o
    if cfg.norm != "none":
        sd[p + "norm1.weight"] = plan.g1_new[i]
        if blk.beta1 is not None:
            sd[p + "norm1.bias"] = blk.beta1 @ a
        # Fold norm2's gain (and bias) into W_1 (and b_1): gamma' = 1, beta' = 0.
        w1 = torch.linalg.solve(o, blk.g2[:, None] * blk.W1)
        b1 = blk.b1
        if blk.beta2 is not None:
            b1 = b1 + blk.beta2 @ blk.W1
            sd[p + "norm2.bias"] = torch.zeros_like(blk.beta2)
        sd[p + "norm2.weight"] = torch.ones_like(blk.g2)
    else:
        w1 = blk.W1 if o is eye else torch.linalg.solve(o, blk.W1)
        b1 = blk.b1
    sd[p + "mlp.fc_in.weight"] = _linear(w1)
    if b1 is not None:
        sd[p + "mlp.fc_in.bias"] = b1
    sd[p + "mlp.fc_out.weight"] = _linear(blk.W2 @ b_next)
    if blk.b2 is not None:
        sd[p + "mlp.fc_out.bias"] = blk.b2 @ b_next


def _apply_ends(sd: dict[str, torch.Tensor], cfg: ModelConfig, plan: _Plan) -> None:
    """The embeddings into the first block's basis, the final norm and head out of the last."""
    norm, eye = cfg.norm != "none", torch.eye(cfg.n_embd, dtype=F64)
    b1_basis, bf = plan.B[0], plan.B_final
    sd["wte.weight"] = sd["wte.weight"] @ b1_basis
    if "wpe.weight" in sd:
        sd["wpe.weight"] = sd["wpe.weight"] @ b1_basis
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["wte.weight"]
        if norm:
            gf = sd["norm_f.weight"]
            G = torch.linalg.solve(bf, torch.diag(gf)) @ torch.linalg.inv(b1_basis).T
            sd["norm_f.weight"] = torch.diagonal(G).clone()
            if "norm_f.bias" in sd:
                sd["norm_f.bias"] = torch.linalg.solve(b1_basis, sd["norm_f.bias"])
        return
    u = _paper(sd["lm_head.weight"])  # (d, V)
    if norm:
        gf = sd["norm_f.weight"]
        if "norm_f.bias" in sd:
            beta = sd["norm_f.bias"]
            if bool((beta != 0).any()) and not bool((gf != 0).all()):
                raise QkvlabError("the final norm has a zero gain and a nonzero bias: its "
                                  "bias cannot be moved into the head")
            sd["norm_f.bias"] = (beta / gf) @ bf if bool((beta != 0).any()) else beta
        u = torch.linalg.solve(bf, gf[:, None] * u)
        sd["norm_f.weight"] = torch.ones_like(gf)
    elif not torch.equal(bf, eye):
        u = torch.linalg.solve(bf, u)
    sd["lm_head.weight"] = _linear(u)


def convert(model: GPT, to: str = "q-identity", *, cond_limit: float = 1e8, tol: float = 1e-8,
            dtype: torch.dtype | None = None) -> tuple[GPT, ConversionReport]:
    """A NEW model with projection=`to` computing the same function as `model` (baseline).

    Picks the theorem of docs/paper.md section 2 from the layout and refuses, with a one-line
    QkvlabError naming the violated hypothesis, whatever is outside it: a norm unless W_X is
    orthogonal (section 3), full skips without shared weights, a tied head with a non-orthogonal
    basis on a residual path, GQA for k/v, a nonzero b_Q, singular or ill-conditioned W_X
    (cond > cond_limit). `tol` bounds each hypothesis' measured defect. The weights are computed
    in float64 and stored in `dtype` (default: the source's).
    """
    plan = _plan(model, to, cond_limit=cond_limit, tol=tol)
    bad = plan.report.violations
    if bad:
        raise QkvlabError(bad[0].message)
    new = _apply(model, plan, to, dtype)
    plan.report.params_before, plan.report.params_after = param_count(model), param_count(new)
    return new, plan.report


def approximate_convert(model: GPT, to: str = "q-identity", *, cond_limit: float = 1e12,
                        tol: float = 1e-8, dtype: torch.dtype | None = None,
                        ) -> tuple[GPT, ConversionReport]:
    """The same recipe without enforcing the theorem's hypotheses: the best available conversion.

    For layouts outside section 2 (a norm with a generic W_X, full skips without sharing, a tied
    head with a non-orthogonal basis) the result is NOT the same function; `report.violations`
    says which hypotheses fail and by how much, and `qkvlab.theory.limits` measures the output
    error. Undefined cases (singular W_X, nonzero b_Q, GQA for k/v) still raise.
    """
    plan = _plan(model, to, cond_limit=cond_limit, tol=tol)
    new = _apply(model, plan, to, dtype)
    plan.report.params_before, plan.report.params_after = param_count(model), param_count(new)
    return new, plan.report
