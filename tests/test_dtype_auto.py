"""train.dtype = "auto" (run/device.py): bf16 where the device has native bf16 matmuls, else
fp32, made concrete before anything records it, so that a run's config.toml, a sweep group's
fingerprint and a resume all see the dtype the run trains with."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
import torch

from helpers import tiny_config
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.experiments.spec import identity_diff, load_spec, parse_spec
from qkvlab.run import device as device_module
from qkvlab.run.config import load_config
from qkvlab.run.device import fast_bf16, on_this_device, resolve_dtype
from qkvlab.train import train
from test_variant_overrides import tiny_compare_args

CPU = torch.device("cpu")
ARCHIVE = Path(__file__).resolve().parents[1] / "docs" / "results" / "sweeps"


def cpu_with(monkeypatch, **flags: bool) -> None:
    """This CPU, as torch.cpu.get_capabilities would describe one with `flags`."""
    found = {"architecture": "x86_64", "avx2": True, **flags}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: found, raising=False)


def bf16_native(monkeypatch, native: bool) -> None:
    monkeypatch.setattr(device_module, "fast_bf16", lambda device: native)


@pytest.mark.parametrize("flags, native", [
    ({}, False),  # AVX2 only: bf16 is emulated
    ({"avx512_f": True, "avx512_bf16": False}, False),  # AVX512 without its bf16 instructions
    ({"avx512_bf16": True}, True),
    ({"amx_bf16": True, "amx_tile": True}, True),
])
def test_a_cpu_has_native_bf16_only_with_bf16_instructions(monkeypatch, flags, native):
    cpu_with(monkeypatch, **flags)
    assert fast_bf16(CPU) is native
    assert resolve_dtype("auto", CPU) == ("bf16" if native else "fp32")


@pytest.mark.parametrize("native", [False, True])
def test_a_gpu_has_native_bf16_where_torch_says_so_without_emulation(monkeypatch, native):
    asked = []

    def supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert resolve_dtype("auto", torch.device("cuda")) == ("bf16" if native else "fp32")
    assert asked == [False]  # an emulated bf16 is no faster than fp32
    assert not fast_bf16(torch.device("meta"))  # nor is another device's


def test_a_torch_without_get_capabilities_asks_its_older_probes(monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert fast_bf16(CPU)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert not fast_bf16(CPU)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_named_dtype_is_kept_whatever_the_device(monkeypatch, dtype):
    cpu_with(monkeypatch, amx_bf16=True)
    assert resolve_dtype(dtype, CPU) == dtype
    cpu_with(monkeypatch)
    assert resolve_dtype(dtype, CPU) == dtype


def test_the_cpu_presets_leave_the_dtype_to_the_machine():
    for preset in ("shakespeare-char", "shakespeare-char-qidentity", "shakespeare-char-llama"):
        assert load_config(preset).train.dtype == "auto", preset
    # the base of the sweeps archived in bf16 keeps it: their records resolve as they were made
    assert load_config("compare-quick").train.dtype == "bf16"
    with pytest.raises(QkvlabError, match="train.dtype must be one of auto, bf16, fp32"):
        load_config("shakespeare-char", ["train.dtype=fp16"])


@pytest.mark.parametrize("native, dtype", [(False, "fp32"), (True, "bf16")])
def test_a_run_records_the_dtype_auto_picked_and_resumes_with_auto(
        data_dir, tmp_path, monkeypatch, native, dtype):
    bf16_native(monkeypatch, native)
    cfg = dataclasses.replace(tiny_config(data_dir, "train.dtype=auto", "train.max_steps=2",
                                          "train.ckpt_interval=2"), out_dir=str(tmp_path / "run"))
    assert on_this_device(cfg, CPU).train.dtype == dtype
    summary = train(cfg, quiet=True)
    assert summary["dtype"] == dtype
    saved = tomllib.loads((tmp_path / "run" / "config.toml").read_text())
    assert saved["train"]["dtype"] == dtype
    state = json.loads(next((tmp_path / "run").glob("ckpt-*/state.json")).read_text())
    assert state["config"]["train"]["dtype"] == dtype
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3))
    assert train(longer, resume=True, quiet=True)["steps"] == 3  # "auto" again: the same dtype


def test_a_resume_where_auto_picks_another_dtype_is_refused(data_dir, tmp_path, monkeypatch):
    bf16_native(monkeypatch, False)
    cfg = dataclasses.replace(tiny_config(data_dir, "train.dtype=auto", "train.max_steps=2",
                                          "train.ckpt_interval=2"), out_dir=str(tmp_path / "run"))
    train(cfg, quiet=True)
    before = (tmp_path / "run" / "config.toml").read_text()
    bf16_native(monkeypatch, True)  # the same folder on a machine with bf16 instructions
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=3))
    with pytest.raises(QkvlabError, match=r"train\.dtype \(saved 'fp32', now 'bf16'\)"):
        train(longer, resume=True, quiet=True)
    assert (tmp_path / "run" / "config.toml").read_text() == before


SPEC = """
[spec]
name = "dtypes"
base = "compare-quick"
set = ["train.max_steps=2", "train.dtype=auto"]

[[variant]]
name = "base"
baseline = true

[[variant]]
name = "wq"
rule = "q-identity"
set = ["train.dtype=bf16"]
"""


@pytest.mark.parametrize("native", [False, True])
def test_a_sweep_group_holds_the_dtype_its_runs_train_with(monkeypatch, native):
    bf16_native(monkeypatch, native)
    groups = {g.name: g for g in parse_spec(tomllib.loads(SPEC), "test").groups()}
    assert groups["base"].config.train.dtype == ("bf16" if native else "fp32")
    assert groups["wq"].config.train.dtype == "bf16"  # named: kept
    others = {g.name: g for g in parse_spec(tomllib.loads(SPEC), "test").groups()}
    assert others["base"].fingerprint == groups["base"].fingerprint
    bf16_native(monkeypatch, not native)
    moved = {g.name: g for g in parse_spec(tomllib.loads(SPEC), "test").groups()}
    assert moved["base"].fingerprint != groups["base"].fingerprint  # another dtype, another run
    assert moved["wq"].fingerprint == groups["wq"].fingerprint


def test_compare_trains_in_auto_and_says_the_dtype_of_each_variant(data_dir, tmp_path,
                                                                    monkeypatch, capsys):
    bf16_native(monkeypatch, False)
    out = tmp_path / "cmp"
    args = tiny_compare_args(data_dir, out)
    at = args.index("train.dtype=fp32")
    del args[at - 1:at + 1]  # the --set and its value
    assert main(args) == 0  # no dtype named: the preset's bf16 becomes "auto", fp32 here
    said = capsys.readouterr().out
    assert "weight decay 0.1, fp32" in said and "weight decay 0.03125, fp32" in said
    rows = json.loads((out / "compare.json").read_text())
    assert {r["dtype"] for r in rows} == {"fp32"}
    assert main(tiny_compare_args(data_dir, tmp_path / "named", "train.dtype=bf16")) == 0
    assert "weight decay 0.1, bf16" in capsys.readouterr().out  # a named dtype is kept


@pytest.mark.parametrize("sweep", sorted(p.name for p in ARCHIVE.iterdir() if p.is_dir()))
@pytest.mark.parametrize("native", [False, True])
def test_every_archived_sweep_still_resolves_as_recorded(monkeypatch, sweep, native):
    bf16_native(monkeypatch, native)  # whatever "auto" would pick on this machine
    record = json.loads((ARCHIVE / sweep / "sweep.json").read_text())
    for g in load_spec(ARCHIVE / sweep).groups():
        old = record["groups"].get(g.name)
        if old is not None:  # a group of the spec that has not run has no record
            assert not identity_diff(old["identity"], g.identity), g.name
