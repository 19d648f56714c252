"""A variant's run config: a base run config with a rule of qkvlab.model.variants applied.

The one policy for `qkvlab compare` and sweep specs: a key the user set for every variant
(`qkvlab compare --set`, `qkvlab sweep --set`, a spec's top-level `set`) is the user's. A rule
that would set it (the attention scale, the weight decay) leaves it as the user set it, and a
rule that derives a size (a wider MLP, narrower heads) derives it from the user's value. A
rule's projection is what the rule is: setting it for every variant is refused in one line
naming the variants whose rule sets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from qkvlab.errors import require
from qkvlab.model.variants import derive, rule_named
from qkvlab.run.config import RunConfig, parse_override

# Keys that make a rule what it is: a setting for every variant cannot take their place.
RULE_DEFINING: frozenset[str] = frozenset({"model.projection"})


def user_keys(overrides: Iterable[str]) -> frozenset[str]:
    """The section.key names that `--set`-style overrides set."""
    return frozenset(".".join(parse_override(item)[:2]) for item in overrides)


def check_user_keys(rules: Mapping[str, str], user: frozenset[str], fix: str) -> None:
    """Refuse (one line) a key set for every variant that the rule of some of them is defined
    by; `rules` maps each variant that has a rule to its rule's name, `fix` says what to do."""
    for key in sorted(user & RULE_DEFINING):
        clash = [name for name, rule in rules.items() if key in rule_named(rule).keys()]
        require(not clash, f"{key} is set for every variant, but the rule of variant(s) "
                           f"{', '.join(clash)} sets it (it is what the rule is): {fix}")


def apply_rule(base: RunConfig, rule: str, user: frozenset[str]) -> RunConfig:
    """`base` (the user's settings already in it) with `rule` applied, the user's keys kept."""
    keep = {key.removeprefix("model.") for key in user - RULE_DEFINING
            if key.startswith("model.")}
    variant = derive(base.model, rule, keep)
    decay = base.optim.weight_decay if "optim.weight_decay" in user else variant.weight_decay
    return dataclasses.replace(base, model=variant.model,
                               optim=dataclasses.replace(base.optim, weight_decay=decay))
