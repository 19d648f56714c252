"""Measured limits (docs/paper.md section 3 and the full-skip case of 2.3): normalization obstructs
the conversion, except for orthogonal W_Q (RMSNorm) or orthogonal W_Q keeping 1 (LayerNorm)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qkvlab.errors import QkvlabError
from qkvlab.theory import approximate_convert, convert
from qkvlab.theory.common import random_model, random_orthogonal
from qkvlab.theory.limits import (
    full_skip_limit,
    norm_limit,
    set_projection_,
    small_config,
    tied_limit,
    zero_query_bias_,
)

PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EXACT, OBSTRUCTION = 1e-9, 1e-6

shapes = st.fixed_dictionaries({
    "n_head": st.sampled_from([1, 2, 4]),
    "d_head": st.integers(2, 4),
    "mlp_hidden": st.integers(2, 24),
    "bias": st.booleans(),
    "n_layer": st.integers(1, 3),
    "seed": st.integers(0, 2**16),
})


def _shape(s: dict) -> dict:
    return dict(n_head=s["n_head"], n_embd=max(s["n_head"] * s["d_head"], 4) // s["n_head"]
                * s["n_head"], mlp_hidden=s["mlp_hidden"], bias=s["bias"])


@PROPS
@given(s=shapes, norm=st.sampled_from(["layernorm", "rmsnorm"]), tie=st.booleans())
def test_normalization_obstructs_a_generic_w_q(s, norm, tie):
    r = norm_limit(norm, "generic", seed=s["seed"], n_layer=s["n_layer"], tie_embeddings=tie,
                   **_shape(s))
    assert not r.report.exact
    assert r.error > OBSTRUCTION


@PROPS
@given(s=shapes, tie=st.booleans(), scaled=st.booleans())
def test_rmsnorm_is_exact_for_orthogonal_w_q(s, tie, scaled):
    r = norm_limit("rmsnorm", "orthogonal", seed=s["seed"], n_layer=s["n_layer"],
                   tie_embeddings=tie, scaled_gains=scaled and not tie, **_shape(s))
    assert r.report.exact, r.report.summary()
    assert r.error < EXACT


@PROPS
@given(s=shapes, tie=st.booleans(), scaled=st.booleans())
def test_layernorm_is_exact_for_orthogonal_w_q_keeping_ones(s, tie, scaled):
    r = norm_limit("layernorm", "orthogonal-ones", seed=s["seed"], n_layer=s["n_layer"],
                   tie_embeddings=tie, scaled_gains=scaled and not tie, **_shape(s))
    assert r.report.exact, r.report.summary()
    assert r.error < EXACT


@PROPS
@given(s=shapes)
def test_layernorm_needs_the_all_ones_direction_kept(s):
    r = norm_limit("layernorm", "orthogonal", seed=s["seed"], n_layer=s["n_layer"], **_shape(s))
    assert not r.report.exact
    assert r.error > OBSTRUCTION


def test_exact_norm_case_is_converted_by_convert_and_generic_one_refused():
    cfg = small_config(norm="layernorm", residual="full", n_layer=2, share_layers=True)
    model = random_model(cfg, 0)
    with pytest.raises(QkvlabError, match=r"^section 3: normalization obstructs .* unless W_Q "
                                          r"is orthogonal \(RMSNorm\)"):
        convert(model)
    with torch.no_grad():
        model.blocks[0].norm1.weight.fill_(1.0)
    set_projection_(model, "q", [random_orthogonal(16, 1, keep_ones=True)])
    new, report = convert(model)
    assert report.theorem.startswith("section 3 (layernorm, orthogonal special case)")
    assert new.cfg.norm == "layernorm" and new.cfg.projection == "q-identity"


@PROPS
@given(s=shapes, n_layer=st.integers(2, 4), to=st.sampled_from(["q-identity", "k-identity",
                                                                  "v-identity"]))
def test_full_skips_without_sharing_keep_an_error(s, n_layer, to):
    r = full_skip_limit(seed=s["seed"], n_layer=n_layer, to=to, **_shape(s))
    assert not r.report.exact
    assert [h.name for h in r.report.violations] == [
        "full skips need one basis for the whole stream (shared weights)"]
    assert r.error > OBSTRUCTION


def test_full_skips_with_equal_bases_are_exact():
    """What the refusal is about is different bases per layer: equal W_Q's convert exactly."""
    cfg = small_config(residual="full", n_layer=3)
    model = random_model(cfg, 0)
    w = random_model(cfg, 9).blocks[0].attn.projections().w_q.detach().T
    set_projection_(model, "q", [w, w, w])
    new, report = convert(model)
    assert report.exact and "every layer with the same W_X" in report.theorem


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tied_head_limit(seed):
    assert tied_limit(seed=seed, orthogonal=True).error < EXACT
    assert tied_limit(seed=seed, orthogonal=False).error > OBSTRUCTION


def test_approximate_convert_still_refuses_undefined_cases():
    model = random_model(small_config(bias=True), 0)  # b_Q != 0
    with pytest.raises(QkvlabError, match="b_Q"):
        approximate_convert(model)
    zero_query_bias_(model)
    _, report = approximate_convert(model)
    assert report.exact and math.isfinite(report.max_condition)


def test_set_projection_checks_shapes():
    model = random_model(small_config(), 0)
    with pytest.raises(QkvlabError, match="need 2 matrices"):
        set_projection_(model, "q", [torch.eye(16, dtype=torch.float64)])
    with pytest.raises(QkvlabError, match="must be 16 x 16"):
        set_projection_(model, "q", [torch.eye(8, dtype=torch.float64)] * 2)
