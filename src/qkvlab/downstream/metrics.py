"""Per-task metrics from the scored items, with lm-eval's definitions.

acc: the choice of highest loglik is the gold one (ties: the first). acc_norm: the same with
each loglik divided by the length of its choice string in characters. LAMBADA: acc is the share
of items whose continuation is the greedy decode, perplexity is exp(-mean loglik) over items.
Every mean is over the scored items; chance is the mean of 1 / number of choices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from qkvlab.downstream.scorer import Scored
from qkvlab.downstream.tasks import Item, Task


@dataclass(frozen=True)
class TaskResult:
    task: str
    lm_eval: str  # the lm-eval task these numbers correspond to
    split: str
    items: int  # read (the first --limit of the file)
    scored: int
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> items
    acc: float | None = None
    acc_norm: float | None = None
    perplexity: float | None = None
    chance: float | None = None  # acc of a uniform guess (multiple choice only)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def argmax(values: Sequence[float]) -> int:
    """Index of the largest value, the first one on a tie (as numpy.argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def normalized(loglik: float, choice: str) -> float:
    # an empty choice: numpy's x / 0 in lm-eval, -inf for any loglik below 0
    return loglik / len(choice) if choice else -math.inf


def multiple_choice(items: Sequence[Item], scores: Sequence[Sequence[Scored]]) -> dict:
    """acc, acc_norm and chance over the scored items."""
    lls = [[s.loglik for s in row] for row in scores]
    acc = [float(argmax(ll) == it.gold) for it, ll in zip(items, lls, strict=True)]
    norm = [float(argmax([normalized(x, c) for x, c in zip(ll, it.choices, strict=True)])
                  == it.gold) for it, ll in zip(items, lls, strict=True)]
    chance = [1 / len(it.requests) for it in items]
    return {"acc": _mean(acc), "acc_norm": _mean(norm), "chance": _mean(chance)}


def lambada(scores: Sequence[Sequence[Scored]]) -> dict:
    """acc (greedy match) and perplexity over the scored items."""
    mean_ll = _mean([row[0].loglik for row in scores])
    ppl = None if mean_ll is None else math.exp(-mean_ll) if -mean_ll < 700 else math.inf
    return {"acc": _mean([float(row[0].greedy) for row in scores]), "perplexity": ppl}


def summarize(task: Task, n_items: int, items: Sequence[Item],
              scores: Sequence[Sequence[Scored]], skipped: dict[str, int]) -> TaskResult:
    """The task's row: `items` are the scored ones, `scores` their per-choice results."""
    found = multiple_choice(items, scores) if task.multiple_choice else lambada(scores)
    kept = {k: v for k, v in found.items() if k in task.metrics or k == "chance"}
    return TaskResult(task.name, task.lm_eval, task.split, n_items, len(items), dict(skipped),
                      **kept)
