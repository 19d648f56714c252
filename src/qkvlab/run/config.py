"""Run configuration: typed sections, TOML presets, `--set` overrides, exact round trips.

A run is described by one TOML file with the sections [run], [model], [data], [optim] and
[train]. `load_config` reads it with tomllib (never executes anything), applies `--set
section.key=value` overrides, and validates every key and type; `save_config` writes the
resolved config back so that `load_config(save_config(cfg))` gives `cfg` again.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import tomli_w

from qkvlab.data.loader import ORDERS
from qkvlab.errors import QkvlabError, require
from qkvlab.fsutil import write_text_atomic
from qkvlab.model.config import ModelConfig, coerce, from_table, migrate_model_table, shown
from qkvlab.model.params import flops_per_token
from qkvlab.run.layout import CONFIG_FILE

# "auto": bf16 where the device has native bf16 matmuls, else fp32 (run/device.py)
DTYPES: tuple[str, ...] = ("auto", "bf16", "fp32")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
# Multi-process wrappers under torchrun (one process trains plainly whatever this says).
PARALLEL: tuple[str, ...] = ("ddp", "fsdp")
OBJECTIVES: tuple[str, ...] = ("clm", "mlm")  # train/objectives.py
SECTIONS: tuple[str, ...] = ("run", "model", "data", "optim", "train")
# The embedded default corpus: the only source that training prepares on its own.
EMBEDDED_SOURCE = "shakespeare"


# what `--set section.key=TEXT` takes as a string without quotes: a word or a path (spaces
# inside allowed), never quotes, brackets, braces, '=', '#', backslashes or control characters
BARE_WORD = re.compile(r"[^\s\"'\[\]{}=#\\][^\"'\[\]{}=#\\\x00-\x1f\x7f]*")
RUN_NAME = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9._+-]*")
# a W&B project or entity name: W&B refuses these characters in one
WANDB_NAME = re.compile(r"[^/\\#?%:\s]{1,128}")
# train.seed: torch.manual_seed takes [-2**63, 2**64) and a saved config.toml holds a TOML
# (64-bit signed) integer, so a seed is in [0, 2**63 - 1]
SEED_MAX = (1 << 63) - 1
SEED_RANGE = "[0, 2**63 - 1]"
# What train.max_steps and optim.warmup_steps mean when a config leaves them (and the key that
# replaces each) unset.
DEFAULT_MAX_STEPS = 5000
DEFAULT_WARMUP_STEPS = 100
# Keys of which a config gives one: the run's length as steps or as a FLOP budget (whose steps
# are also the schedule's horizon, so it excludes optim.decay_steps too), the warmup as steps or
# as a share of the run. Both in one config are refused; a `--set` or a sweep variant that sets
# a key drops the keys it replaces from the layer below (apply_overrides, set_key).
REPLACES: dict[str, tuple[str, ...]] = {
    "train.max_steps": ("train.flop_budget",),
    "train.flop_budget": ("train.max_steps", "optim.decay_steps"),
    "optim.warmup_steps": ("optim.warmup_fraction",),
    "optim.warmup_fraction": ("optim.warmup_steps",),
}
# Keys added after sweeps were archived, at the values that mean what those sweeps ran: a
# sweep's fingerprint leaves them out at these values (experiments/spec.py), as
# model.config.FINGERPRINT_NEUTRAL does for [model].
FINGERPRINT_NEUTRAL: dict[str, Any] = {"train.flop_budget": None, "optim.warmup_fraction": None}


def valid_seed(value: Any) -> bool:
    """True for an integer a run can be seeded with (SEED_MAX)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= SEED_MAX


def _to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass
class DataConfig:
    """Where the prepared tokens live and how to make them if they are missing."""

    dir: str = "data/shakespeare-char"
    source: str = EMBEDDED_SOURCE
    tokenizer: str = "char"
    # Only the embedded corpus is prepared automatically: anything else may be a big download.
    prepare_if_missing: bool = True
    # How training windows are drawn: "random" offsets (with replacement, nanoGPT's way) or
    # "shuffled" disjoint windows, each token once an epoch (data/loader.py).
    order: str = "random"

    def __post_init__(self) -> None:
        for name in ("dir", "source", "tokenizer"):
            require(bool(getattr(self, name)), f"invalid config: data.{name} must not be empty")
        require(self.order in ORDERS, "invalid config: data.order must be one of "
                f"{', '.join(ORDERS)}, got {self.order!r}")

    def prepare_hint(self) -> str:
        """The `qkvlab prepare` command line that creates this data dir."""
        return f"qkvlab prepare {self.source} --tokenizer {self.tokenizer} --out {self.dir}"


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule (linear warmup, cosine to min_lr)."""

    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int | None = None  # None: DEFAULT_WARMUP_STEPS, unless warmup_fraction is set
    # the warmup as a share of the run's steps (RunConfig.warmup_steps, rounded): a schedule
    # that keeps its shape when train.flop_budget sets the length. Replaces warmup_steps.
    warmup_fraction: float | None = None
    # Cosine horizon; None means the run's steps. May exceed them (the paper: 600k vs 105k).
    decay_steps: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)

    def __post_init__(self) -> None:
        require(math.isfinite(self.lr) and self.lr > 0,
                f"invalid config: optim.lr must be > 0, got {self.lr}")
        require(0 <= self.min_lr <= self.lr,
                f"invalid config: optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.warmup_fraction is None:
            if self.warmup_steps is None:
                self.warmup_steps = DEFAULT_WARMUP_STEPS
            require(self.warmup_steps >= 0,
                    f"invalid config: optim.warmup_steps must be >= 0, got {self.warmup_steps}")
            require(self.decay_steps is None or self.decay_steps > self.warmup_steps,
                    f"invalid config: optim.decay_steps must exceed warmup_steps="
                    f"{self.warmup_steps} or be unset, got {self.decay_steps}")
        else:
            require(self.warmup_steps is None,
                    "invalid config: optim.warmup_steps and optim.warmup_fraction are both set: "
                    "keep one (the fraction sizes the warmup to the run's steps)")
            require(0 <= self.warmup_fraction < 1,
                    f"invalid config: optim.warmup_fraction must be in [0, 1), got "
                    f"{self.warmup_fraction}")
        require(self.weight_decay >= 0,
                f"invalid config: optim.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            require(0 <= value < 1, f"invalid config: optim.{name} must be in [0, 1), got {value}")
        require(self.eps > 0, f"invalid config: optim.eps must be > 0, got {self.eps}")
        require(self.grad_clip >= 0,
                f"invalid config: optim.grad_clip must be >= 0, got {self.grad_clip}")


@dataclass
class TrainConfig:
    """Loop length, batch shape, evaluation, logging, checkpoints, numerics and device."""

    max_steps: int | None = None  # None: DEFAULT_MAX_STEPS, unless flop_budget is set
    # Training FLOPs the run may spend, as qkvlab counts them (model/params.py's
    # flops_per_token x tokens per step x steps): the steps are the most it pays for, and the
    # lr schedule's horizon follows them (RunConfig.steps). Replaces max_steps.
    flop_budget: float | None = None
    batch_size: int = 64  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    eval_interval: int = 250  # also evaluates at step 0 and at the end
    eval_windows: int = 256  # fixed val windows of block_size tokens, the same for every run
    eval_batch_size: int | None = None  # None means batch_size
    # After the last step, the val loss over this many target tokens in windows spread over
    # the whole val split (all of it when it holds fewer), per part of the corpus where the
    # data records them: summary.json's final_val_loss_long. 0 turns it off.
    final_eval_tokens: int = 1 << 20
    log_interval: int = 10
    ckpt_interval: int = 1000  # also checkpoints at the end and on SIGINT/SIGTERM
    keep_last: int = 2  # ckpt-* folders kept, besides best/
    seed: int = 1337
    dtype: str = "bf16"
    compile: bool | None = None  # None: on for CUDA, off for CPU
    device: str = "auto"
    max_nonfinite: int = 5  # consecutive non-finite steps before giving up
    peak_flops: float | None = None  # for MFU; None: known GPU table, else measured once
    tensorboard: bool = True  # write tb/ events when tensorboard is installed
    # log the same scalars, the config and the run folder's name to Weights & Biases (the
    # wandb extra; train/wandb_log.py): offline without an API key, never in training's way
    wandb: bool = False
    wandb_project: str = "qkvlab"
    wandb_entity: str | None = None  # None: the API key's default entity
    # under torchrun: "ddp" replicates the model, "fsdp" shards it (FSDP2) when it does not fit
    parallel: str = "ddp"
    # "clm": next-token prediction; "mlm": BERT-style masked tokens (needs model.causal = false;
    # train/objectives.py)
    objective: str = "clm"
    mlm_prob: float = 0.15  # mlm: share of positions selected for prediction

    def __post_init__(self) -> None:
        if self.flop_budget is None:
            if self.max_steps is None:
                self.max_steps = DEFAULT_MAX_STEPS
        else:
            require(self.max_steps is None,
                    "invalid config: train.max_steps and train.flop_budget are both set: keep "
                    "one (the budget decides the number of steps)")
            require(self.flop_budget > 0, f"invalid config: train.flop_budget must be > 0 "
                                          f"(training FLOPs) or unset, got {self.flop_budget}")
        for name in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_windows",
                     "log_interval", "ckpt_interval", "keep_last", "max_nonfinite"):
            value = getattr(self, name)
            if value is None:  # max_steps under a flop budget
                continue
            require(value >= 1, f"invalid config: train.{name} must be >= 1, got {value}")
        require(self.final_eval_tokens >= 0,
                f"invalid config: train.final_eval_tokens must be >= 0 (0 turns the final "
                f"long evaluation off), got {self.final_eval_tokens}")
        require(self.eval_batch_size is None or self.eval_batch_size >= 1,
                f"invalid config: train.eval_batch_size must be >= 1 or unset, got "
                f"{self.eval_batch_size}")
        require(valid_seed(self.seed), f"invalid config: train.seed must be an integer in "
                                       f"{SEED_RANGE}, got {shown(self.seed)}")
        for name, choices in (("dtype", DTYPES), ("device", DEVICES), ("parallel", PARALLEL),
                              ("objective", OBJECTIVES)):
            value = getattr(self, name)
            require(value in choices, f"invalid config: train.{name} must be one of "
                                      f"{', '.join(choices)}, got {value!r}")
        require(self.peak_flops is None or self.peak_flops > 0,
                f"invalid config: train.peak_flops must be > 0 or unset, got {self.peak_flops}")
        require(0 < self.mlm_prob < 1,
                f"invalid config: train.mlm_prob must be in (0, 1), got {self.mlm_prob}")
        for name in ("wandb_project", "wandb_entity"):
            value = getattr(self, name)
            require(value is None or bool(WANDB_NAME.fullmatch(value)),
                    f"invalid config: train.{name} must be 1 to 128 characters without "
                    f"/ \\ # ? % : or spaces, got {shown(value)}")


@dataclass
class RunConfig:
    """A whole run: model shape, data, optimizer and loop, plus where the run folder is."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    name: str = "run"
    out_dir: str | None = None  # None means runs/<name>

    def __post_init__(self) -> None:
        # a causal model cannot see the context right of a masked token
        require(self.train.objective != "mlm" or not self.model.causal,
                "invalid config: train.objective = mlm needs a bidirectional encoder: set "
                "model.causal = false")
        budget = self.train.flop_budget
        if budget is not None:
            require(self.optim.decay_steps is None,
                    "invalid config: optim.decay_steps and train.flop_budget are both set: the "
                    "budget's steps are the schedule's horizon; drop optim.decay_steps")
            per_step = self.flops_per_step
            require(self.steps >= 1,
                    f"invalid config: train.flop_budget = {budget:.4g} FLOPs does not pay for "
                    f"one step of this model ({per_step:.4g} FLOPs: "
                    f"{flops_per_token(self.model):.4g} per token x {self.tokens_per_step:,} "
                    "tokens): raise the budget or shrink the model or the batch")
            # a schedule fitted to the budget decays after its warmup
            require(self.steps > self.warmup_steps,
                    f"invalid config: train.flop_budget = {budget:.4g} FLOPs buys "
                    f"{self.steps} steps, no more than the warmup's {self.warmup_steps}: set "
                    "optim.warmup_fraction (e.g. 0.1) or fewer optim.warmup_steps")
        decay = self.optim.decay_steps
        require(decay is None or decay > self.warmup_steps,
                f"invalid config: optim.decay_steps must exceed the warmup's "
                f"{self.warmup_steps} steps or be unset, got {decay}")

    def on_device(self, device_type: str) -> RunConfig:
        """This config with model.attn_impl = "auto" made the kernel of `device_type` and
        train.dtype, which must be resolved ("bf16" or "fp32", see run/device.py)."""
        model = self.model.on_device(device_type, self.train.dtype)
        return self if model is self.model else replace(self, model=model)

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) if self.out_dir else Path("runs") / self.name

    @property
    def steps(self) -> int:
        """The optimizer steps the run trains: train.max_steps, or the most whole steps that
        train.flop_budget pays for. What the trainer, resume, sweeps and reports all read."""
        budget = self.train.flop_budget
        if budget is None:
            return self.train.max_steps  # type: ignore[return-value]  # set without a budget
        return budget_steps(budget, self.flops_per_step)

    @property
    def flops_per_step(self) -> float:
        """Training FLOPs of one optimizer step, as qkvlab counts them (model/params.py)."""
        return flops_per_token(self.model, training=True) * self.tokens_per_step

    @property
    def train_flops(self) -> float:
        """Training FLOPs of the whole run (at most train.flop_budget where one is set)."""
        return self.steps * self.flops_per_step

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used: optim.warmup_steps, or warmup_fraction of the steps."""
        fraction = self.optim.warmup_fraction
        if fraction is None:
            return self.optim.warmup_steps  # type: ignore[return-value]  # set without one
        return round(fraction * self.steps)

    @property
    def decay_steps(self) -> int:
        """The cosine horizon actually used: optim.decay_steps, else the run's steps (under a
        flop budget always those: the schedule fitted to the budget)."""
        return self.optim.decay_steps or self.steps

    @property
    def tokens_per_step(self) -> int:
        t = self.train
        return t.batch_size * t.grad_accum * self.model.block_size

    def to_dict(self) -> dict[str, Any]:
        """Nested plain data, the TOML layout (None values kept; `save_config` drops them)."""
        return {
            "run": {"name": self.name, "out_dir": self.out_dir},
            "model": self.model.to_dict(),
            "data": _to_dict(self.data),
            "optim": _to_dict(self.optim),
            "train": _to_dict(self.train),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from the TOML layout; missing sections and keys take their defaults."""
        unknown = sorted(set(data) - set(SECTIONS))
        if unknown:
            raise QkvlabError(
                f"unknown section(s) {', '.join(unknown)}; valid sections: {', '.join(SECTIONS)}"
            )
        run = data.get("run", {})
        if not isinstance(run, dict):
            raise QkvlabError(f"[run] must be a table of key = value pairs, got {run!r}")
        run_keys = ("name", "out_dir")
        bad = sorted(set(run) - set(run_keys))
        if bad:
            raise QkvlabError(
                f"unknown key(s) {', '.join(bad)} in [run]; valid keys: {', '.join(run_keys)}"
            )
        name = coerce(run.get("name", "run"), "str", "run.name")
        out_dir = coerce(run.get("out_dir"), "str | None", "run.out_dir")
        require(bool(name.strip()), "invalid config: run.name must not be empty")
        # runs/<name> must stay inside runs/: one path component (out_dir is the user's own)
        require(bool(RUN_NAME.fullmatch(name)),
                f"invalid config: run.name must be one folder name of letters, digits and "
                f". _ - + (not starting with .), got {name!r}; set run.out_dir for a folder "
                f"elsewhere")
        model = data.get("model", {})
        if not isinstance(model, dict):
            raise QkvlabError(f"[model] must be a table of key = value pairs, got {model!r}")
        return cls(
            model=ModelConfig.from_dict(model, where="model"),
            data=from_table(DataConfig, data.get("data", {}), "data"),
            optim=from_table(OptimConfig, data.get("optim", {}), "optim"),
            train=from_table(TrainConfig, data.get("train", {}), "train"),
            name=name,
            out_dir=out_dir or None,
        )


def budget_steps(budget: float, flops_per_step: float) -> int:
    """floor(budget / flops_per_step), exactly: a budget of k steps' FLOPs buys k steps."""
    return math.floor(Fraction(budget) / Fraction(flops_per_step))


# ---- presets ------------------------------------------------------------------------------
def preset_names() -> list[str]:
    """Names of the TOML presets shipped in qkvlab/configs/."""
    root = resources.files("qkvlab") / "configs"
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir()
                  if p.name.endswith(".toml"))


def preset_text(name: str) -> str:
    """The TOML text of a shipped preset."""
    path = resources.files("qkvlab") / "configs" / f"{name.removesuffix('.toml')}.toml"
    return path.read_text(encoding="utf-8")


def preset_summary(name: str) -> str:
    """The first comment line of a preset, used as its description."""
    for line in preset_text(name).splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
    return ""


# ---- loading, overrides, saving -----------------------------------------------------------
def _read_toml(text: str, origin: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise QkvlabError(f"{origin} is not valid TOML ({exc}): fix the file") from None
    except RecursionError:  # arrays nested thousands deep: tomllib recurses per level
        raise QkvlabError(f"{origin} nests too deeply to be a config: fix the file") from None
    except ValueError:  # an integer of over 4,300 digits: Python refuses to read it
        raise QkvlabError(f"{origin} holds a number too long to read: fix the file") from None


def read_config_source(path_or_preset: str | Path) -> tuple[dict[str, Any], str]:
    """The raw TOML dict of a config file, a run folder (its config.toml) or a preset name."""
    path = Path(path_or_preset).expanduser()
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        data, origin = read_config_source(path / CONFIG_FILE)
        run = data.get("run", {})  # a run folder's record leaves out the folder holding it
        if isinstance(run, dict) and run.get("out_dir") is None:
            data = {**data, "run": {**run, "out_dir": str(path)}}
        return data, origin
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise QkvlabError(f"cannot read config {path} ({exc}): check the path") from None
        data = _read_toml(text, f"config {path}")
        # a run's saved config (the name runs give it) may predate keys: read it as it was meant
        return (migrate_saved(data) if path.name == CONFIG_FILE else data), str(path)
    name = str(path_or_preset).removesuffix(".toml")
    if name in preset_names():
        return _read_toml(preset_text(name), f"preset {name}"), f"preset {name}"
    raise QkvlabError(
        f"config {path_or_preset} is neither a file nor a preset: give a TOML file, a run folder, "
        f"or one of the presets {', '.join(preset_names())}"
    )


def migrate_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config (its config.toml, a checkpoint's state.json) in today's terms: its
    [model] table through model.config.migrate_model_table."""
    return {**data, "model": migrate_model_table(data.get("model", {}))}


def saved_config(data: dict[str, Any]) -> RunConfig:
    """The RunConfig of a run's saved config, as the version that wrote it meant it."""
    return RunConfig.from_dict(migrate_saved(data))


def parse_override(item: str, default_section: str | None = None) -> tuple[str, str, Any]:
    """Split 'section.key=value' into (section, key, value); value is a TOML literal or a string.

    With `default_section`, a plain 'key=value' means that section's key (`qkvlab bench
    --set n_layer=4`).
    """
    target, sep, raw = item.partition("=")
    target = target.strip()
    if default_section and "." not in target:
        target = f"{default_section}.{target}"
    section, dot, key = target.partition(".")
    if not sep or not dot or not section or not key or "." in key:
        form, example = ((f"key=value or {default_section}.key=value", "KEY=VALUE")
                         if default_section else ("section.key=value", "optim.lr=1e-3"))
        raise QkvlabError(f"override {item!r} is not {form}: write e.g. --set {example}")
    value = _override_value(item, f"{section}.{key}", raw.strip())
    if not isinstance(value, str) and _field_type(section, key).startswith("str"):
        value = raw.strip()  # a text field given what TOML reads as a number or date (2024)
    return section, key, value


def _override_value(item: str, target: str, raw: str) -> Any:
    """The value of a `--set`: a TOML literal, else a bare word or path taken as a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        # a bare word such as q-identity or a path is taken as a string; anything else that is
        # not TOML (an unterminated quote, a bracket, a space) is a mistake, not a string
        require(BARE_WORD.fullmatch(raw) is not None,
                f"--set {item!r}: {raw!r} is not a TOML value; quote a string "
                f"({target}=\"...\") or give a bare word or path without quotes, brackets or "
                "braces")
        return raw
    except ValueError:  # an integer of over 4,300 digits: Python refuses to read it
        raise QkvlabError(f"--set {item[:60]!r}...: the number is too long to be a config "
                          "value") from None
    except RecursionError:  # brackets nested thousands deep: tomllib recurses per level
        raise QkvlabError(f"--set {item[:60]!r}...: the value nests too deeply to be a "
                          "config value") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `--set` overrides to a raw config dict (a copy); validation happens later."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in SECTIONS:
            raise QkvlabError(
                f"unknown section {section!r} in --set {item}; valid sections: "
                f"{', '.join(SECTIONS)}"
            )
        set_key(out, section, key, value)
    return out


def set_key(data: dict[str, Any], section: str, key: str, value: Any) -> None:
    """data[section][key] = value in a raw config dict, dropping the key it replaces
    (REPLACES): a later layer's length or warmup replaces the one below it."""
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise QkvlabError(f"[{section}] in the config is not a table: fix the config file")
    table[key] = value
    for other in REPLACES.get(f"{section}.{key}", ()):
        other_section, _, other_key = other.partition(".")
        other_table = data.get(other_section)
        if isinstance(other_table, dict):
            other_table.pop(other_key, None)


def _field_type(section: str, key: str) -> str:
    """The annotation string of section.key ("" when the section or key is unknown)."""
    if section == "run":
        return {"name": "str", "out_dir": "str | None"}.get(key, "")
    cls = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
           "train": TrainConfig}.get(section)
    return next((str(f.type) for f in fields(cls) if f.name == key), "") if cls else ""


def load_config(path_or_preset: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML config (file, run folder or preset name) and apply `--set` overrides."""
    data, _origin = read_config_source(path_or_preset)
    return RunConfig.from_dict(apply_overrides(data, list(overrides or [])))


def _drop_none(table: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in table.items() if v is not None}


def config_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML text (None values omitted: absent means None)."""
    data = {section: _drop_none(table) for section, table in cfg.to_dict().items()}
    text = tomli_w.dumps(data)
    m = cfg.model
    if isinstance(m.attn_scale, str):  # record the number a rule resolves to beside the rule
        line = f"attn_scale = {tomli_w.dumps({'v': m.attn_scale})[4:].strip()}\n"
        what = "initial value; times a learned gain per head" if m.learned_scale else "resolved"
        text = text.replace(line, f"{line[:-1]}  # {what}: {m.scale:.6g}\n", 1)
    return text


def as_recorded(cfg: RunConfig) -> RunConfig:
    """The config as a run folder records it (config.toml, a checkpoint's state.json): without
    out_dir, which is the folder holding the record; reading a run folder puts it back."""
    return replace(cfg, out_dir=None)


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config as TOML, atomically; `load_config(path)` gives `cfg` back."""
    return write_text_atomic(Path(path), config_toml(cfg))


# ---- resume -------------------------------------------------------------------------------
# Keys that may differ between a run's saved config and the one it resumes with: they change
# bookkeeping (length, logging, where things are), not the training trajectory.
RESUME_HARMLESS = frozenset({
    "run.name", "run.out_dir", "data.dir", "data.prepare_if_missing",
    "train.max_steps", "train.eval_interval", "train.eval_windows", "train.eval_batch_size",
    "train.final_eval_tokens",
    "train.log_interval", "train.ckpt_interval", "train.keep_last", "train.compile",
    "train.device", "train.max_nonfinite", "train.peak_flops", "train.tensorboard",
    "train.wandb", "train.wandb_project", "train.wandb_entity",
    # DDP vs FSDP is how processes share the work, not what they compute; the world size is
    # not in the config at all: the global batch is the same for any number of processes
    "train.parallel",
})


# Keys in which a finished run may differ from the config a command asks for and still be its
# answer (compare and sweep reuse finished runs): RESUME_HARMLESS less what the results are
# measured at, the run's length and its evaluations.
REUSE_HARMLESS = RESUME_HARMLESS - {"train.max_steps", "train.eval_interval",
                                    "train.eval_windows"}


def config_diff(saved: RunConfig, now: RunConfig,
                harmless: frozenset[str] = RESUME_HARMLESS) -> list[str]:
    """The keys outside `harmless` where `now` differs from `saved`, in words: by default the
    trajectory-deciding ones (what a resume checks); with REUSE_HARMLESS, what a finished run
    must match to be reused."""
    a, b = saved.to_dict(), now.to_dict()
    diffs = []
    for section in a:
        for key in sorted(set(a[section]) | set(b.get(section, {}))):
            name = f"{section}.{key}"
            old, new = a[section].get(key), b.get(section, {}).get(key)
            if name not in harmless and old != new:
                diffs.append(f"{name} (saved {old!r}, now {new!r})")
    return diffs
