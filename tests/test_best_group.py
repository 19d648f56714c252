"""The best of several groups (experiments/results.best_group, behind the report's tuned-lr
table and its lr grid): picked on the seeds every candidate finished, so seeds added later to a
few groups (a stage 2 of three seeds) measure the choice without changing it."""

from __future__ import annotations

from pathlib import Path

from qkvlab.experiments.results import GroupResult, best_group
from qkvlab.experiments.runs import RunData
from qkvlab.experiments.stats import summarize


def group(name: str, finals: dict[int, float], failed: tuple[int, ...] = ()) -> GroupResult:
    runs = [RunData(name, s, Path(name), "done", 10, 10, final_loss=v) for s, v in finals.items()]
    runs += [RunData(name, s, Path(name), "failed", 10) for s in failed]
    none = summarize([])
    return GroupResult(None, None, {}, 0, runs, summarize(list(finals.values())), none, none)


def test_a_seed_added_to_one_group_does_not_change_the_choice():
    lucky = group("lucky", {1: 1.40, 2: 1.52, 3: 1.50})  # best on seed 1, its mean 1.473
    other = group("other", {1: 1.45})  # mean 1.45: lower than lucky's, on one seed only
    assert best_group([lucky, other]) is lucky
    assert best_group([other, lucky]) is lucky


def test_the_shared_seeds_decide_and_a_failed_run_shares_none():
    a = group("a", {1: 1.50, 2: 1.40})
    b = group("b", {1: 1.45, 2: 1.48}, failed=(3,))
    c = group("c", {1: 1.46, 2: 1.47, 3: 1.20})
    assert best_group([a, b, c]) is a  # seeds 1 and 2: a 1.450, b 1.465, c 1.465


def test_without_a_shared_seed_each_groups_own_mean_decides():
    a = group("a", {1: 1.50})
    b = group("b", {2: 1.44, 3: 1.46})
    assert best_group([a, b]) is b
