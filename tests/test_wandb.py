"""W&B logging (train.wandb, train/wandb_log.py) in W&B's offline mode: what the offline run
holds, read back from its transaction log, against metrics.jsonl and TensorBoard; resume into
the same W&B run; a missing or failing wandb never stops a run."""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from pathlib import Path

import pytest

from helpers import tiny_config
from qkvlab.errors import QkvlabError
from qkvlab.run.layout import WANDB_DIR, WANDB_RUN_FILE
from qkvlab.run.metrics import read_metrics
from qkvlab.train.trainer import train

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402  (after the importorskip)

# the metrics.jsonl key of each scalar the trainer logs
TAGS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm",
        "train/tokens_per_s": "tokens_per_s", "train/mfu": "mfu", "val/loss": "val_loss"}


@pytest.fixture(autouse=True)
def offline(tmp_path, monkeypatch):
    """W&B offline, its settings, cache and credentials in tmp_path (no key, no netrc)."""
    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR", "WANDB_ENTITY",
                 "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.chdir(tmp_path)  # wandb also reads ./wandb/settings
    yield
    wandb.teardown()  # the next test's wandb reads its environment afresh


def config(data_dir: Path, out: Path, *extra: str):
    return tiny_config(data_dir, "train.wandb=true", f"run.out_dir={out}", *extra)


# ---- reading an offline run back ----------------------------------------------------------
def records(path: Path):
    """The records of a .wandb transaction log: the leveldb log format (32 KiB blocks of
    checksummed chunks after a 7-byte ':W&B' header), each record a protobuf Record."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's trailer too short for a chunk header: zero padding
            pos += left
            continue
        crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind == 0:
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc
        pending += chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(run_dir: Path) -> list[Path]:
    """The .wandb files of a run folder's W&B sessions, oldest first, each once it is written
    out: wandb-core writes the log in its own process, and on a loaded machine its last flush
    can land after run.finish has returned. A finished session's log ends in its exit record."""
    paths = sorted((run_dir / WANDB_DIR).glob("offline-run-*/run-*.wandb"))
    for path in paths:
        deadline = time.monotonic() + 60
        while not _has_exit(path):
            assert time.monotonic() < deadline, f"{path} has no exit record"
            time.sleep(0.1)
    return paths


def _has_exit(path: Path) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in records(path))
    except AssertionError:  # a chunk still being written
        return False


def history(path: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of every scalar the session logged."""
    out = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") != "history":
            continue
        row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item}
        out.update({(tag, row["_step"]): value for tag, value in row.items()
                    if not tag.startswith("_")})
    return out


def run_record(path: Path):
    return next(r.run for r in records(path) if r.WhichOneof("record_type") == "run")


def expected(run_dir: Path, after: int = -1) -> dict[tuple[str, int], float]:
    """What metrics.jsonl says the scalars of steps > `after` are (step 0: the initial eval),
    and summary.json the final loss over the long validation set (val/loss_long)."""
    out = {(tag, r["step"]): r[key] for r in read_metrics(run_dir) if r["step"] > after
           for tag, key in TAGS.items()
           if r.get(key) is not None and (r["step"] > 0 or tag == "val/loss")}
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("final_val_loss_long"):
        out[("val/loss_long", summary["steps"])] = summary["final_val_loss_long"]["loss"]
    return out


# ---- the tests ----------------------------------------------------------------------------
def test_offline_run_logs_metrics_config_and_name(data_dir, tmp_path, capsys):
    run = tmp_path / "run-a"
    cfg = config(data_dir, run, "train.tensorboard=true", "train.wandb_project=qk-test")
    train(cfg, quiet=True)
    assert capsys.readouterr().err == ""
    [log] = offline_runs(run)
    logged = history(log)
    assert logged == expected(run)  # every scalar, exactly as in metrics.jsonl
    assert {step for _, step in logged} == set(range(9))
    meta = run_record(log)
    assert meta.display_name == "run-a" and meta.project == "qk-test"
    config_seen = {i.key: json.loads(i.value_json) for i in meta.config.update}
    assert config_seen["train"]["max_steps"] == 8 and config_seen["train"]["wandb"] is True
    assert config_seen["model"]["n_embd"] == 32 and config_seen["run"]["out_dir"] == str(run)
    assert json.loads((run / WANDB_RUN_FILE).read_text())["id"] == meta.run_id
    # TensorBoard has the same tags at the same steps (its values are float32)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(run / "tb"))
    tb.Reload()
    tb_logged = {(tag, e.step): e.value for tag in tb.Tags()["scalars"] for e in tb.Scalars(tag)}
    assert tb_logged.keys() == logged.keys()
    assert all(tb_logged[k] == pytest.approx(v, rel=1e-6) for k, v in logged.items())


def test_resume_logs_into_the_same_wandb_run(data_dir, tmp_path):
    run = tmp_path / "run"
    # no long final eval: the first session's, at its last step 4, is in no record the
    # second session leaves (summary.json holds the last one)
    no_long = "train.final_eval_tokens=0"
    train(config(data_dir, run, "train.max_steps=4", no_long), quiet=True)  # ckpt-0000004
    first = json.loads((run / WANDB_RUN_FILE).read_text())["id"]
    train(config(data_dir, run, no_long), resume=True, quiet=True)  # to step 8 (harmless keys)
    assert json.loads((run / WANDB_RUN_FILE).read_text())["id"] == first
    one, two = offline_runs(run)
    assert run_record(one).run_id == run_record(two).run_id == first
    assert {step for _, step in history(one)} == set(range(5))
    assert history(two) == expected(run, after=4)  # only the steps after the checkpoint
    assert history(one) | history(two) == expected(run)
    # the resume was not refused for a link out of the folder (wandb-core links its log in
    # ~/.cache/wandb), and none is left now either; W&B's links inside it stay
    assert not outside_links(run) and any(p.is_symlink() for p in run.rglob("*"))
    # a session killed inside wandb.init leaves the link: the next session removes it first
    link = core_log_link(run, "offline-run-killed")
    train(config(data_dir, run, "train.wandb=false", no_long), resume=True, quiet=True)
    assert not link.is_symlink() and not outside_links(run)


def test_no_api_key_falls_back_to_offline(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE")
    run = tmp_path / "run"
    summary = train(config(data_dir, run, "train.max_steps=2"))
    out = capsys.readouterr()
    assert summary["steps"] == 2 and "warning" not in out.err
    assert out.out.count("no API key configured, logging offline") == 1
    [log] = offline_runs(run)
    assert history(log) == expected(run)


def core_log_link(run_dir: Path, session: str) -> Path:
    """What wandb-core makes in a session's folder: a link to its log out of the run folder."""
    logs = run_dir / WANDB_DIR / session / "logs"
    logs.mkdir(parents=True)
    (logs / "debug-core.log").symlink_to(run_dir.parent / "core-debug.log")
    return logs / "debug-core.log"


def failing_init(**kwargs):
    core_log_link(Path(kwargs["dir"]), "run-failed")
    raise RuntimeError("the service is unreachable")


def outside_links(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*")
            if p.is_symlink() and not p.resolve().is_relative_to(run_dir.resolve())]


class BrokenRun:
    """A W&B run whose log calls fail (finish still works)."""

    id, step = "broken1", 0
    finished: int | None = None  # the exit code it was finished with

    def log(self, *args, **kwargs):
        raise OSError("the disk is full")

    def finish(self, exit_code=0):
        BrokenRun.finished = exit_code


@pytest.mark.parametrize("fault", ["missing", "init", "log"])
def test_a_broken_wandb_warns_once_and_training_goes_on(data_dir, tmp_path, monkeypatch,
                                                        capsys, fault):
    if fault == "missing":
        monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    elif fault == "init":
        monkeypatch.setattr(wandb, "init", failing_init)
    else:
        BrokenRun.finished = None
        monkeypatch.setattr(wandb, "init", lambda **kwargs: BrokenRun())
    run = tmp_path / "run"
    summary = train(config(data_dir, run), quiet=True)
    assert summary["steps"] == 8 and read_metrics(run)[-1]["step"] == 8
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: "), err
    assert {"missing": "wandb cannot be imported", "init": "the service is unreachable",
            "log": "the disk is full"}[fault] in err[0]
    assert not offline_runs(run) and not outside_links(run)
    if fault == "log":
        assert BrokenRun.finished == 1  # given up on, and finished as failed at the end
    else:
        assert not (run / WANDB_RUN_FILE).exists()


def test_wandb_off_writes_nothing(data_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not even imported: no warning
    run = tmp_path / "run"
    train(tiny_config(data_dir, f"run.out_dir={run}", "train.max_steps=2"), quiet=True)
    assert capsys.readouterr().err == ""
    assert not (run / WANDB_DIR).exists() and not (run / WANDB_RUN_FILE).exists()


@pytest.mark.parametrize("key, value", [("wandb_project", "a/b"), ("wandb_project", ""),
                                        ("wandb_entity", "my team"),
                                        ("wandb_project", "x" * 129)])
def test_bad_names_are_refused(data_dir, tmp_path, key, value):
    with pytest.raises(QkvlabError, match=f"train.{key} must be 1 to 128 characters"):
        tiny_config(data_dir, f"train.{key}={json.dumps(value)}")
