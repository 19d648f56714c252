"""A trained model converted to W_Q = I: same validation loss, d^2 fewer parameters per layer.

No normalization, skips around attention only (docs/paper.md section 2.2), trained for a few hundred
steps on the embedded corpus with plain AdamW, then converted and evaluated in float64.
"""

from __future__ import annotations

import time

import pytest
import torch

from qkvlab.data.loader import TokenData
from qkvlab.data.prepare import prepare
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.theory import convert
from qkvlab.theory.convert_checkpoint import compare_models

pytestmark = pytest.mark.slow  # trains a model for a few hundred steps

STEPS, BATCH, CTX, D, LAYERS = 300, 16, 64, 64, 2


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> TokenData:
    out = tmp_path_factory.mktemp("theory-data") / "shakespeare-char"
    prepare("shakespeare", "char", out, log=lambda _msg: None)
    return TokenData(out)


def train_small(data: TokenData) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=LAYERS, n_head=4, n_embd=D, block_size=CTX,
                      vocab_size=data.vocab_size, norm="none", residual="attention",
                      tie_embeddings=True, dropout=0.0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    for step in range(STEPS):
        x, y = data.train_batch(step, 0, BATCH, CTX, seed=0)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def test_trained_model_converts_with_the_same_validation_loss(data):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a small model: one thread is as fast and robust to a busy CPU
    try:
        start = time.perf_counter()
        model = train_small(data)
        trained_s = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    x, y = data.val_windows(64, CTX)

    exact, report = convert(model, "q-identity", dtype=torch.float64)
    stored, _ = convert(model, "q-identity")  # float32, as a checkpoint would hold it
    c64 = compare_models(model, exact, x, y)
    c32 = compare_models(model, stored, x, y)
    print(f"\ntrained {STEPS} steps in {trained_s:.1f} s; {report.theorem}\n"
          f"val loss {c64.val_loss_before:.8f} -> {c64.val_loss_after:.8f} "
          f"(|diff| {c64.loss_diff:.2e}, max |logit diff| {c64.max_logit_diff:.2e}); "
          f"stored in float32: |diff| {c32.loss_diff:.2e}, max |logit diff| "
          f"{c32.max_logit_diff:.2e}; params {report.params_before} -> {report.params_after} "
          f"(saved {report.params_saved}); max cond {report.max_condition:.3g}")

    assert c64.val_loss_before < 2.9  # it did learn (uniform over 65 chars is 4.17)
    assert c64.loss_diff < 1e-6
    assert c32.loss_diff < 1e-5  # float32 storage of the converted weights only
    assert report.params_saved == LAYERS * D * D
    assert exact.cfg.projection == "q-identity"
    assert exact.cfg.attn_scale == pytest.approx(model.cfg.scale)
