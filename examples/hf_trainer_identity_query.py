"""Train a tiny Llama with transformers' Trainer on tinyshakespeare, as is and with W_Q = I.

    python examples/hf_trainer_identity_query.py [--steps 300] [--out /tmp/qkvlab-trainer]

The only line W_Q = I adds to an ordinary Trainer script is `identity_query(model, scale=...)`
before training; the W_Q = I arm also takes the paper's weight decay (2^-5 instead of 0.1).
Byte-level tokens (vocabulary 256), so no tokenizer files are needed. Prints both models'
parameter counts and their train and validation losses; each arm's model is saved with
`save_pretrained` and the W_Q = I one is reloaded in plain transformers to show equal logits.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from qkvlab.data.corpus import shakespeare_path
from qkvlab.hf import identity_query

BLOCK = 64


class Windows(Dataset):
    """Fixed random windows of BLOCK bytes (labels = inputs: the model shifts them)."""

    def __init__(self, data: torch.Tensor, count: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(data) - BLOCK, (count,), generator=g)
        self.data = data

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[self.starts[i]: self.starts[i] + BLOCK]
        return {"input_ids": ids, "labels": ids}


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # both arms start from the same K, V, O and MLP weights
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True))


def train(arm: str, train_set: Dataset, val_set: Dataset, steps: int, out: Path) -> dict:
    model = tiny_llama()
    decay = 0.1
    if arm == "W_Q = I":
        print(identity_query(model, scale="paper").summary())
        decay = 2 ** -5  # the paper's weight decay for W_Q = I
    args = TrainingArguments(
        output_dir=str(out / "trainer"), max_steps=steps, per_device_train_batch_size=16,
        learning_rate=2e-3, lr_scheduler_type="cosine", warmup_steps=steps // 10,
        weight_decay=decay, logging_steps=max(1, steps // 5), save_strategy="no",
        report_to=[], use_cpu=True, seed=0, data_seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=train_set, eval_dataset=val_set)
    result = trainer.train()
    val = trainer.evaluate()["eval_loss"]
    model.save_pretrained(out / arm.replace(" ", "").replace("=", "-"))
    return {"arm": arm, "params": model.num_parameters(), "train": result.training_loss,
            "val": val, "model": model}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("/tmp/qkvlab-trainer-example"))
    a = parser.parse_args()
    data = torch.tensor(list(shakespeare_path().read_bytes()), dtype=torch.long)
    cut = int(0.9 * len(data))
    train_set, val_set = Windows(data[:cut], 16 * a.steps, 1), Windows(data[cut:], 256, 2)
    runs = [train(arm, train_set, val_set, a.steps, a.out) for arm in ("baseline", "W_Q = I")]
    print(f"\n{'arm':<10}{'parameters':>12}{'train loss':>12}{'val loss':>10}")
    for r in runs:
        print(f"{r['arm']:<10}{r['params']:>12,}{r['train']:>12.4f}{r['val']:>10.4f}")

    saved = a.out / "W_Q-I"
    plain = LlamaForCausalLM.from_pretrained(saved).eval()  # unpatched transformers
    x = val_set[0]["input_ids"][None]
    with torch.no_grad():
        diff = (plain(x).logits - runs[1]["model"].eval()(x).logits).abs().max().item()
    print(f"{saved} in plain transformers: {plain.num_parameters():,} parameters (q_proj = r I "
          f"written out), max logit difference {diff:.2e}")


if __name__ == "__main__":
    main()
