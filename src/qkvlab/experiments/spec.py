"""Experiment specs: a grid of model variants x seeds over one base run config, as TOML data.

A spec is a TOML file (data only: nothing is executed) with one [spec] table and one
[[variant]] table per variant::

    [spec]
    name = "cpu-paper"                 # also the default output folder, runs/sweeps/<name>
    description = "..."
    base = "compare-quick"             # a preset, a config file (relative to the spec) or a run
    set = ["model.n_embd=256"]         # --set style overrides of the base, applied first
    seeds = [1, 2, 3]                  # train.seed: initial weights and batch order

    [[variant]]
    name = "baseline"
    baseline = true                    # exactly one: the reference of the paired differences
    rule = "baseline"                  # a named derivation of qkvlab.model.variants

    [[variant]]
    name = "q-identity"
    rule = "q-identity"                # W_Q = I, scale / 2, weight decay 2^-5
    grid = { weight_decay = [0.01, 0.03125] }   # cartesian product: one group per point

A variant starts from the base, applies its `rule` (the paper's derivations, written once in
variants.py; a key the spec's `set` or `--set` names stays as the user set it, see
experiments/rules.py), then its fields (a whitelist of model and optimizer keys and
train.flop_budget, VARIANT_FIELDS), then its grid point, then its own `set` overrides.
Anything else is refused with the valid keys.

One (variant, grid point) is a *group*; a group times a seed is a *run*, trained in
<out>/<group>/seed-<seed>/. A group's fingerprint is the sha256 of its resolved config without
the keys that do not change the trajectory (config.RESUME_HARMLESS, the seed and the paths):
the sweep records them and refuses a folder whose groups were made by a different spec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from qkvlab.errors import QkvlabError
from qkvlab.experiments.rules import apply_rule, check_user_keys, user_keys
from qkvlab.model.config import old_record_nulls
from qkvlab.model.scale import alpha_of
from qkvlab.model.variants import RULES
from qkvlab.run.config import (
    FINGERPRINT_NEUTRAL,
    REPLACES,
    RESUME_HARMLESS,
    SEED_RANGE,
    RunConfig,
    apply_overrides,
    load_config,
    parse_override,
    saved_config,
    set_key,
    valid_seed,
)

SPEC_KEYS: tuple[str, ...] = ("name", "description", "base", "set", "seeds", "out")
VARIANT_META: tuple[str, ...] = ("name", "description", "baseline", "rule", "family", "versus",
                                 "grid", "set")
# The variant fields and the config section each one sets. What is not here goes through the
# variant's `set` list, so a typo in a field name is an error, not a silently ignored key.
VARIANT_FIELDS: dict[str, str] = {
    "projection": "model", "attn_scale": "model", "n_layer": "model", "n_head": "model",
    "n_embd": "model", "head_dim": "model", "n_kv_head": "model", "mlp_hidden": "model",
    "mlp_ratio": "model", "causal": "model", "activation": "model", "norm": "model",
    "positions": "model", "residual": "model", "dropout": "model", "vocab_size": "model",
    "mlp": "model",
    "lr": "optim", "min_lr": "optim", "weight_decay": "optim", "warmup_steps": "optim",
    "warmup_fraction": "optim", "decay_steps": "optim", "beta2": "optim",
    "flop_budget": "train",
}
# Short names for grid values in folder names: q-identity.wd0.01.lr0.002
ABBREV: dict[str, str] = {"weight_decay": "wd", "min_lr": "minlr", "attn_scale": "scale",
                          "mlp_ratio": "mlp", "mlp_hidden": "hidden", "n_embd": "d",
                          "n_layer": "L", "n_head": "H", "decay_steps": "decay",
                          "warmup_fraction": "warmup", "flop_budget": "flops"}
MAX_GRID_POINTS = 10_000  # per variant: beyond this a spec is a mistake, not an experiment
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")  # safe as a folder name
SPECS_PACKAGE = "qkvlab.experiments"
SPECS_DIR = "specs"
# Keys that never enter a fingerprint besides config.RESUME_HARMLESS: what differs per seed
# or per folder.
_PER_RUN_KEYS = frozenset({"train.seed", "run.name", "run.out_dir"})


def _err(where: str, msg: str) -> QkvlabError:
    return QkvlabError(f"{where}: {msg}")


@dataclass(frozen=True)
class VariantSpec:
    """One [[variant]] table, checked but not yet resolved against the base config."""

    name: str
    description: str = ""
    baseline: bool = False
    rule: str | None = None
    family: str = ""  # groups runs in the report's stability view; default: the name
    versus: str = ""  # the family its IsoFLOP minima are compared with; default: the baseline's
    fields: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    set: tuple[str, ...] = ()

    def points(self) -> list[dict[str, Any]]:
        """The grid points in order (one empty point without a grid)."""
        keys = list(self.grid)
        return [dict(zip(keys, values, strict=True))
                for values in itertools.product(*(self.grid[k] for k in keys))]


@dataclass(frozen=True)
class Group:
    """A variant at one grid point: everything about its runs except the seed."""

    name: str  # the folder name: the variant name plus the grid point, e.g. q-identity.wd0.01
    variant: str  # the [[variant]] name
    family: str
    versus: str  # the reference family of its IsoFLOP comparison ("": the baseline's)
    point: dict[str, Any]
    baseline: bool
    description: str
    config: RunConfig  # the base seed and no out_dir: runs fill those in
    identity: dict[str, Any]  # what the fingerprint hashes
    fingerprint: str


@dataclass(frozen=True)
class Run:
    """One training run of the sweep: a group at one seed, in its own folder."""

    group: Group
    seed: int
    config: RunConfig

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def label(self) -> str:
        return f"{self.group.name} seed {self.seed}"


@dataclass
class Spec:
    """A parsed spec. `groups()` resolves it against its base config."""

    name: str
    base: str
    variants: list[VariantSpec]
    seeds: list[int]
    description: str = ""
    set: tuple[str, ...] = ()
    out: str | None = None
    source: str = ""  # where it was read from, for messages
    spec_dir: Path | None = None  # relative base paths are resolved against this folder
    sweep_dir: Path | None = None  # set when the spec was read from a sweep folder's copy

    @property
    def default_out(self) -> Path:
        if self.sweep_dir is not None:
            return self.sweep_dir
        return Path(self.out) if self.out else Path("runs") / "sweeps" / self.name

    def base_source(self) -> str:
        """The base as load_config takes it: a file next to the spec wins over a preset name."""
        if self.spec_dir is not None and not Path(self.base).is_absolute():
            near = self.spec_dir / self.base
            if near.exists():
                return str(near.resolve())
        return self.base

    def base_config(self, overrides: list[str] | None = None) -> RunConfig:
        try:
            return load_config(self.base_source(), [*self.set, *(overrides or [])])
        except QkvlabError as exc:
            raise _err(f"spec {self.name}, base {self.base}", str(exc)) from None

    def with_overrides(self, overrides: list[str]) -> Spec:
        """This spec with a sweep's `--set` overrides folded into its `set` (one item per key,
        at its first place, with its last value): it resolves as `groups(overrides)` does, and
        the copy a sweep folder keeps of it resolves so without them (`qkvlab report SWEEP`,
        `qkvlab sweep SWEEP`)."""
        if not overrides:
            return self
        merged: dict[str, str] = {}
        for item in [*self.set, *overrides]:
            section, key, _ = parse_override(item)
            merged[f"{section}.{key}"] = item  # an existing key keeps its place
            for other in REPLACES.get(f"{section}.{key}", ()):  # a length replaces a length
                merged.pop(other, None)
        return dataclasses.replace(self, set=list(merged.values()))

    def baseline(self) -> VariantSpec:
        return next(v for v in self.variants if v.baseline)

    def groups(self, overrides: list[str] | None = None) -> list[Group]:
        """Every (variant, grid point), resolved and validated, in spec order."""
        base = self.base_config(overrides)
        user = user_keys([*self.set, *(overrides or [])])
        try:
            check_user_keys({v.name: v.rule for v in self.variants if v.rule}, user,
                            "set it in those variants' own `set` instead (or give them no rule)")
        except QkvlabError as exc:
            raise _err(f"spec {self.name}", str(exc)) from None
        groups: list[Group] = []
        seen: dict[str, str] = {}
        for v in self.variants:
            for point in v.points():
                name = group_name(v.name, point)
                where = f"spec {self.name}, variant {v.name}"
                if not NAME_RE.match(name):
                    raise _err(where, f"grid point {point} gives the folder name {name!r}, which "
                                      "is not a plain name: use plainer grid values")
                if name in seen:
                    raise _err(where, f"the group name {name} is also made by variant "
                                      f"{seen[name]}: rename one of them")
                seen[name] = v.name
                cfg = variant_config(base, v, point, where, user)
                identity = config_identity(cfg)
                groups.append(Group(
                    name=name, variant=v.name, family=v.family or v.name, versus=v.versus,
                    point=dict(point),
                    baseline=v.baseline, description=v.description, config=cfg,
                    identity=identity, fingerprint=_sha256(identity)))
        return groups

    def runs(
        self,
        out: Path,
        seeds: list[int] | None = None,
        only: list[str] | None = None,
        overrides: list[str] | None = None,
        groups: list[Group] | None = None,
    ) -> list[Run]:
        """The runs under `out`, seed-major (seed 1 of every group first), filtered by `only`."""
        groups = groups if groups is not None else self.groups(overrides)
        if only:
            known = {g.name for g in groups} | {g.variant for g in groups} | \
                {g.family for g in groups}
            unknown = [o for o in only if o not in known]
            if unknown:
                raise QkvlabError(f"--only {', '.join(unknown)}: not a variant of spec "
                                  f"{self.name}; its variants: "
                                  f"{', '.join(dict.fromkeys(g.name for g in groups))}")
            groups = [g for g in groups if {g.name, g.variant, g.family} & set(only)]
        runs = []
        for seed in seeds if seeds is not None else self.seeds:
            for g in groups:
                cfg = dataclasses.replace(
                    g.config, train=dataclasses.replace(g.config.train, seed=seed),
                    name=f"{self.name}-{g.name}-seed{seed}",
                    out_dir=str(Path(out) / g.name / f"seed-{seed}"))
                runs.append(Run(g, seed, cfg))
        return runs

    def fingerprint(self, groups: list[Group]) -> str:
        """sha256 of the resolved spec: its name and every group's fingerprint (not the seeds,
        so seeds can be added to a sweep later)."""
        return _sha256({"spec": self.name, "groups": {g.name: g.fingerprint for g in groups}})

    def to_toml(self) -> str:
        """The spec as TOML data, with a relative base file made absolute (for the copy a sweep
        keeps in its folder, which must work from there)."""
        head: dict[str, Any] = {"name": self.name}
        if self.description:
            head["description"] = self.description
        head["base"] = self.base_source()
        if self.set:
            head["set"] = list(self.set)
        head["seeds"] = list(self.seeds)
        if self.out:
            head["out"] = self.out
        variants = []
        for v in self.variants:
            t: dict[str, Any] = {"name": v.name}
            if v.description:
                t["description"] = v.description
            if v.baseline:
                t["baseline"] = True
            if v.rule:
                t["rule"] = v.rule
            if v.family:
                t["family"] = v.family
            if v.versus:
                t["versus"] = v.versus
            t.update(v.fields)
            if v.grid:
                t["grid"] = v.grid
            if v.set:
                t["set"] = list(v.set)
            variants.append(t)
        return tomli_w.dumps({"spec": head, "variant": variants})


# ---- names, configs, fingerprints ---------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _part(key: str, value: Any) -> str:
    alpha = alpha_of(value) if key == "attn_scale" else None
    if alpha is not None:  # "4/sqrt(d_k)" holds a slash: .alpha4
        return f".alpha{alpha:g}"
    if key == "flop_budget" and not isinstance(value, bool) and isinstance(value, int | float):
        return ".flops" + re.sub(r"e\+0*", "e", f"{float(value):g}")  # 1.6e+14: .flops1.6e14
    return f".{ABBREV.get(key, key)}{_fmt(value)}"


def group_name(variant: str, point: dict[str, Any]) -> str:
    """variant plus .<key><value> per grid key, e.g. q-identity.wd0.01.lr0.002 (an attention
    scale written A/sqrt(d_k): .alphaA)."""
    return variant + "".join(_part(k, v) for k, v in point.items())


def variant_config(base: RunConfig, v: VariantSpec, point: dict[str, Any], where: str,
                   user: frozenset[str] = frozenset()) -> RunConfig:
    """base -> rule (the `user` keys kept, experiments/rules.py) -> fields -> grid point -> the
    variant's `set`, validated as a RunConfig, its attention kernel that of this machine. The
    fields and grid point are set before the rule too, so that a rule deriving a size (a wider
    MLP) derives it from the variant's own shape, not the base's."""
    fields = {**v.fields, **point}

    def with_fields(cfg: RunConfig) -> dict[str, Any]:
        data = cfg.to_dict()
        for key, value in fields.items():
            set_key(data, VARIANT_FIELDS[key], key, value)  # a budget replaces max_steps
        return data

    try:
        if v.rule:
            base = apply_rule(RunConfig.from_dict(with_fields(base)), v.rule, user)
        data = apply_overrides(with_fields(base), list(v.set))
        return _on_this_machine(RunConfig.from_dict(data))
    except QkvlabError as exc:
        raise _err(where + (f" at {point}" if point else ""), str(exc)) from None


def _on_this_machine(cfg: RunConfig) -> RunConfig:
    """attn_impl and train.dtype = "auto" made those of the device train.device names here, so
    that a run folder's config.toml, the fingerprints and --reuse all see what the run trains
    with."""
    if cfg.model.attn_impl != "auto" and cfg.train.dtype != "auto":
        return cfg
    import torch  # only for what is left to the device

    from qkvlab.run.device import device_type, on_this_device

    return on_this_device(cfg, torch.device(device_type(cfg.train.device)))


def config_identity(cfg: RunConfig) -> dict[str, Any]:
    """The config keys that decide the training trajectory of a group (not seed or paths)."""
    skip = RESUME_HARMLESS | _PER_RUN_KEYS

    def kept(name: str, value: Any) -> bool:
        return name not in skip and not (name in FINGERPRINT_NEUTRAL
                                         and value == FINGERPRINT_NEUTRAL[name])

    identity = {section: {k: v for k, v in table.items() if kept(f"{section}.{k}", v)}
                for section, table in cfg.to_dict().items() if section != "run"}
    identity["model"] = old_record_nulls(identity["model"])  # as older sweeps' records hold it
    return identity


def identity_diff(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """section.key (old -> new) for each key whose value differs.

    A key the old record lacks (a config key added to qkvlab since) counts as what it meant
    when the record was written, as it does when the trainer reads an old config
    (run.config.saved_config); a key only the old record has (removed since) is ignored.
    """
    defaults = config_identity(saved_config({}))
    out = []
    for section in sorted(new):
        a, b = old.get(section, {}), new[section]
        for key in sorted(b):
            before = a[key] if key in a else defaults.get(section, {}).get(key)
            if before != b[key]:
                out.append(f"{section}.{key} ({before!r} -> {b[key]!r})")
    return out


def _sha256(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---- parsing -------------------------------------------------------------------------------
def _check_keys(table: Any, valid: tuple[str, ...] | list[str], where: str) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _err(where, f"must be a table of key = value pairs, got {table!r}")
    unknown = sorted(set(table) - set(valid))
    if unknown:
        raise _err(where, f"unknown field(s) {', '.join(unknown)}; valid fields: "
                          f"{', '.join(valid)}")
    return table


def _str(value: Any, where: str, *, name: bool = False) -> str:
    if not isinstance(value, str) or (name and not NAME_RE.match(value)):
        kind = "a plain name (letters, digits, . _ + -)" if name else "a string"
        raise _err(where, f"must be {kind}, got {value!r}")
    return value


def _str_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _err(where, f"must be a list of 'section.key=value' strings, got {value!r}")
    return tuple(value)


def _scalar(value: Any) -> bool:
    return isinstance(value, bool | int | float | str)


def parse_variant(table: Any, where: str) -> VariantSpec:
    valid = [*VARIANT_META, *VARIANT_FIELDS]
    table = _check_keys(table, valid, where)
    if "name" not in table:
        raise _err(where, "has no name")
    name = _str(table["name"], f"{where}.name", name=True)
    where = f"variant {name}"
    baseline = table.get("baseline", False)
    if not isinstance(baseline, bool):
        raise _err(f"{where}.baseline", f"must be true or false, got {baseline!r}")
    rule = table.get("rule")
    if rule is not None and rule not in RULES:
        raise _err(f"{where}.rule", f"unknown rule {rule!r}; valid rules: {', '.join(RULES)}")
    grid = table.get("grid", {})
    if not isinstance(grid, dict):
        raise _err(f"{where}.grid", f"must be a table of key = [values], got {grid!r}")
    bad = sorted(set(grid) - set(VARIANT_FIELDS))
    if bad:
        raise _err(f"{where}.grid", f"unknown field(s) {', '.join(bad)}; grid fields: "
                                    f"{', '.join(VARIANT_FIELDS)}")
    size = 1
    for key, values in grid.items():
        if not isinstance(values, list) or not values or not all(_scalar(v) for v in values):
            raise _err(f"{where}.grid.{key}", f"must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise _err(f"{where}.grid.{key}", f"lists a value twice: {values!r}")
        if key in table:
            raise _err(where, f"sets {key} both as a field and in its grid: keep one")
        size *= len(values)
    if size > MAX_GRID_POINTS:
        raise _err(f"{where}.grid", f"has {size:,} points (more than {MAX_GRID_POINTS:,}): "
                                    "split the grid")
    if baseline and grid:
        raise _err(where, "is the baseline and has a grid: the baseline is one reference "
                          "group; put the grid on another variant (family = "
                          f"\"{name}\" joins it to the baseline in the stability view)")
    return VariantSpec(
        name=name,
        description=_str(table.get("description", ""), f"{where}.description"),
        baseline=baseline,
        rule=rule,
        family=_str(table.get("family", ""), f"{where}.family"),
        versus=_str(table.get("versus", ""), f"{where}.versus"),
        fields={k: table[k] for k in VARIANT_FIELDS if k in table},
        grid={k: list(v) for k, v in grid.items()},
        set=_str_list(table.get("set", []), f"{where}.set"),
    )


def parse_spec(data: dict[str, Any], source: str, spec_dir: Path | None = None) -> Spec:
    """A Spec from the TOML data of a spec file; every mistake is a QkvlabError naming it."""
    _check_keys(data, ["spec", "variant"], f"spec {source}")
    head = _check_keys(data.get("spec"), SPEC_KEYS, f"[spec] of {source}") \
        if "spec" in data else None
    if head is None:
        raise QkvlabError(f"spec {source} has no [spec] table: it needs at least name and base")
    for key in ("name", "base"):
        if key not in head:
            raise QkvlabError(f"[spec] of {source} has no {key}")
    name = _str(head["name"], "[spec].name", name=True)
    seeds = head.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(valid_seed(s) for s in seeds):
        raise QkvlabError(f"spec {name}: seeds must be a non-empty list of integers in "
                          f"{SEED_RANGE}, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise QkvlabError(f"spec {name}: seeds lists a seed twice: {seeds!r}")
    tables = data.get("variant", [])
    if not isinstance(tables, list) or not tables:
        raise QkvlabError(f"spec {name} has no [[variant]] tables: add at least a baseline")
    variants = [parse_variant(t, f"spec {name}, variant #{i + 1}") for i, t in enumerate(tables)]
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise QkvlabError(f"spec {name}: variant name(s) {', '.join(dup)} used twice")
    baselines = [v.name for v in variants if v.baseline]
    if len(baselines) != 1:
        found = f"{len(baselines)}: {', '.join(baselines)}" if baselines else "none"
        raise QkvlabError(f"spec {name}: mark exactly one variant baseline = true (the "
                          f"reference of the paired differences), found {found}")
    _check_versus(name, variants)
    out = head.get("out")
    return Spec(
        name=name,
        base=_str(head["base"], "[spec].base"),
        variants=variants,
        seeds=list(seeds),
        description=_str(head.get("description", ""), "[spec].description"),
        set=_str_list(head.get("set", []), "[spec].set"),
        out=_str(out, "[spec].out") if out is not None else None,
        source=source,
        spec_dir=spec_dir,
    )


def _check_versus(spec: str, variants: list[VariantSpec]) -> None:
    """Each `versus` names another family of the spec, and a family's variants agree on it (a
    family is one IsoFLOP curve, compared with one reference)."""
    families = {v.family or v.name for v in variants}
    chosen: dict[str, str] = {}
    for v in variants:
        fam = v.family or v.name
        if v.versus and v.versus not in families:
            raise QkvlabError(f"spec {spec}: variant {v.name} has versus = {v.versus!r}, not a "
                              f"family of the spec; its families: {', '.join(sorted(families))}")
        if v.versus == fam:
            raise QkvlabError(f"spec {spec}: variant {v.name} has versus = its own family "
                              f"{fam!r}: name the family it is compared with")
        if chosen.setdefault(fam, v.versus) != v.versus:
            raise QkvlabError(f"spec {spec}: family {fam} has versus = {chosen[fam]!r} and "
                              f"{v.versus!r} (variant {v.name}): give its variants one")


def spec_names() -> list[str]:
    """The specs shipped in qkvlab/experiments/specs/."""
    root = resources.files(SPECS_PACKAGE) / SPECS_DIR
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir()
                  if p.name.endswith(".toml"))


def spec_text(name: str) -> str:
    return (resources.files(SPECS_PACKAGE) / SPECS_DIR / f"{name}.toml").read_text("utf-8")


def _parse_text(text: str, origin: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise QkvlabError(f"{origin} is not valid TOML ({exc}): fix the file") from None
    except RecursionError:
        raise QkvlabError(f"{origin} nests too deeply to be a spec: fix the file") from None
    except ValueError:  # an integer of over 4,300 digits: Python refuses to read it
        raise QkvlabError(f"{origin} holds a number too long to read: fix the file") from None


SPEC_COPY = "spec.toml"  # the copy of the spec a sweep folder keeps


def load_spec(spec_or_path: str | Path) -> Spec:
    """A shipped spec name, a spec file, or a sweep folder (its spec.toml copy)."""
    path = Path(spec_or_path).expanduser()
    if path.is_dir():
        copy = path / SPEC_COPY
        if not copy.is_file():
            raise QkvlabError(f"{path} is a folder without {SPEC_COPY}: give a spec file, a "
                              f"shipped spec ({', '.join(spec_names())}) or a sweep folder")
        spec = _load_file(copy)
        spec.sweep_dir = path
        return spec
    if path.is_file():
        return _load_file(path)
    name = str(spec_or_path).removesuffix(".toml")
    if name in spec_names():
        return parse_spec(_parse_text(spec_text(name), f"spec {name}"), f"spec {name}")
    raise QkvlabError(f"spec {spec_or_path} is neither a file, a sweep folder nor a shipped "
                      f"spec; shipped specs: {', '.join(spec_names())}")


def _load_file(path: Path) -> Spec:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise QkvlabError(f"cannot read spec {path} ({exc}): check the path") from None
    return parse_spec(_parse_text(text, f"spec {path}"), str(path), path.resolve().parent)


def spec_summary(name: str) -> str:
    """A shipped spec's one-line summary: its first comment line, else its description."""
    for line in spec_text(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    try:
        desc = load_spec(name).description
    except QkvlabError as exc:
        return f"(invalid: {exc})"
    return desc if len(desc) <= 100 else desc[:97] + "..."
