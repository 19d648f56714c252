"""The training loop's state, transition by transition, without training (plain objects)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qkvlab.run.checkpoint import Checkpoint
from qkvlab.run.config import RunConfig
from qkvlab.train.loop_state import LoopState, Throughput


def folder(run: Path, step: int) -> Path:
    path = run / f"ckpt-{step:07d}"
    path.mkdir(parents=True)
    return path


# ---- saved: with and without an eval of the same weights ------------------------------------
def test_a_checkpoint_measured_by_a_finite_eval_is_good_at_once(tmp_path):
    st = LoopState()
    st.stepped(4, finite=True)
    st.measured(4, 2.5)
    st.saved(4, folder(tmp_path, 4))
    assert st.last_good == st.last_ckpt == tmp_path / "ckpt-0000004"
    assert st.pending is None


def test_a_checkpoint_measured_by_a_nan_eval_is_neither_good_nor_pending(tmp_path):
    st = LoopState()
    st.stepped(4, finite=True)
    st.measured(4, math.nan)
    st.saved(4, folder(tmp_path, 4))
    assert st.last_good is None and st.pending is None
    assert st.last_ckpt == tmp_path / "ckpt-0000004"


def test_an_unmeasured_checkpoint_is_pending_until_a_finite_step(tmp_path):
    st = LoopState()
    st.stepped(2, finite=True)
    st.measured(2, 3.0)  # an older eval: it did not measure the weights after step 3
    st.stepped(3, finite=True)
    path = folder(tmp_path, 3)
    st.saved(3, path)
    assert st.pending == path and st.last_good is None
    st.stepped(4, finite=False)  # a skipped step proves nothing
    assert st.pending == path and st.last_good is None
    assert (st.nonfinite, st.skipped) == (1, 1)
    st.stepped(5, finite=True)  # started from the checkpoint's weights: they work
    assert st.last_good == path and st.pending is None
    assert (st.step, st.nonfinite, st.skipped) == (5, 0, 1)


def test_a_checkpoint_inside_a_nonfinite_streak_is_never_good(tmp_path):
    st = LoopState()
    st.stepped(1, finite=False)
    st.measured(1, 2.0)  # even an eval of these weights does not clear them
    path = folder(tmp_path, 1)
    st.saved(1, path)
    assert st.last_ckpt == path and st.pending is None and st.last_good is None
    st.stepped(2, finite=True)
    assert st.last_good is None  # nothing was pending to promote


def test_a_new_checkpoint_replaces_the_pending_one(tmp_path):
    st = LoopState()
    st.stepped(1, finite=True)
    st.saved(1, folder(tmp_path, 1))
    st.measured(2, 2.0)
    st.stepped(2, finite=True)  # promotes ckpt 1
    st.saved(2, folder(tmp_path, 2))  # measured: good at once
    assert st.last_good == tmp_path / "ckpt-0000002" and st.pending is None


# ---- divergence --------------------------------------------------------------------------------
def test_diverged_counts_consecutive_nonfinite_steps_only():
    st = LoopState()
    for step, finite in enumerate([False, False, True, False, False], start=1):
        st.stepped(step, finite)
        assert not st.diverged(3)
    st.stepped(6, finite=False)
    assert st.diverged(3) and st.skipped == 5
    st.stepped(7, finite=True)
    assert not st.diverged(3) and not st.diverged(0)  # a finite step never ends a run


@pytest.mark.parametrize("val_finite", [True, False])
def test_the_divergence_eval_judges_the_pending_checkpoint(tmp_path, val_finite):
    st = LoopState()
    old, new = folder(tmp_path, 2), folder(tmp_path, 4)
    st.last_good = old
    st.stepped(4, finite=True)
    st.saved(4, new)
    st.judged(val_finite)
    assert st.pending is None
    assert st.last_good == (new if val_finite else old)
    assert st.good_checkpoint() == st.last_good


def test_good_checkpoint_is_none_once_its_folder_is_gone(tmp_path):
    st = LoopState(last_good=folder(tmp_path, 2))
    assert st.good_checkpoint() == tmp_path / "ckpt-0000002"
    (tmp_path / "ckpt-0000002").rmdir()  # keep_last pruned it, or a user removed it
    assert st.good_checkpoint() is None


# ---- evals and best/ ---------------------------------------------------------------------------
def test_step_zero_sets_the_bar_and_later_evals_must_beat_it():
    st = LoopState()
    assert not st.improves(0, 3.0)  # the initial weights never go to best/
    st.set_best(0, 3.0)
    assert st.best_val_loss == 3.0
    assert not st.improves(2, 3.0) and not st.improves(2, math.nan)
    assert st.improves(2, 2.9)
    st.set_best(2, 2.9)
    assert st.best_val_loss == 2.9
    st.set_best(0, 3.5)  # a step-0 eval can only lower the bar
    assert st.best_val_loss == 2.9


def test_measured_remembers_the_step_it_measured():
    st = LoopState()
    st.measured(6, 2.25)
    assert (st.last_val_loss, st.last_val_step) == (2.25, 6)
    assert st.best_val_loss == math.inf  # only keep_best moves the bar


# ---- restore from state.json -------------------------------------------------------------------
def checkpoint(path: Path, **state) -> Checkpoint:
    return Checkpoint(path=path, config=RunConfig(), state={"step": 6, **state})


def test_resumed_from_a_measured_checkpoint_makes_it_good(tmp_path):
    path = folder(tmp_path, 6)
    st = LoopState.resumed(checkpoint(path, best_val_loss=2.0, val_loss=2.1, val_loss_step=6,
                                      last_good=None, skipped_steps=3))
    assert (st.step, st.best_val_loss, st.last_val_loss, st.last_val_step) == (6, 2.0, 2.1, 6)
    assert st.last_ckpt == st.last_good == path and st.pending is None
    assert (st.skipped, st.nonfinite) == (3, 0)


def test_resumed_from_an_unmeasured_checkpoint_keeps_it_pending(tmp_path):
    older, path = folder(tmp_path, 4), folder(tmp_path, 6)
    st = LoopState.resumed(checkpoint(path, val_loss=2.1, val_loss_step=4,
                                      last_good="ckpt-0000004"))
    assert st.pending == path and st.last_good == older
    assert st.best_val_loss == math.inf and st.skipped == 0  # old state.json: no such keys


@pytest.mark.parametrize("name", ["ckpt-0000002", "../ckpt-0000004", "best", 4, None])
def test_resumed_names_only_an_existing_checkpoint_of_its_run(tmp_path, name):
    folder(tmp_path, 4)
    path = folder(tmp_path, 6)
    st = LoopState.resumed(checkpoint(path, val_loss_step=True, last_good=name))
    assert st.last_good is None  # missing, outside the run, not a ckpt-*, not a name
    assert st.last_val_step is None and st.pending == path  # a bool is not a step


def test_resumed_after_a_nan_eval_is_neither_good_nor_pending(tmp_path):
    path = folder(tmp_path, 6)
    st = LoopState.resumed(checkpoint(path, val_loss=None, val_loss_step=6))
    assert st.last_good is None and st.pending is None


def test_checkpoint_fields_round_trip_through_resumed(tmp_path):
    st = LoopState()
    st.set_best(0, 3.0)
    st.stepped(2, finite=True)
    st.measured(2, 2.5)
    st.set_best(2, 2.5)
    st.saved(2, folder(tmp_path, 2))
    st.stepped(3, finite=False)
    st.stepped(4, finite=True)
    fields = st.checkpoint_fields()
    assert list(fields) == ["best_val_loss", "val_loss", "val_loss_step", "last_good"]
    assert fields["last_good"] == "ckpt-0000002"
    path = folder(tmp_path, 4)
    back = LoopState.resumed(checkpoint(path, **fields, skipped_steps=st.skipped, step=4))
    assert (back.best_val_loss, back.last_val_loss, back.last_val_step, back.skipped) == \
        (2.5, 2.5, 2, 1)
    assert back.last_good == tmp_path / "ckpt-0000002" and back.pending == path


# ---- throughput --------------------------------------------------------------------------------
def test_throughput_windows_totals_and_eta():
    clock = Throughput()
    assert clock.tokens_per_s == 0.0 and clock.eta(10) == math.inf
    assert clock.add(0.5, 100) == 200.0
    assert clock.add(1.5, 100) == 100.0  # the window spans both steps
    clock.new_window()
    assert clock.add(0.25, 100) == 400.0
    assert (clock.tokens, clock.seconds) == (300, 2.25)
    assert clock.tokens_per_s == 300 / 2.25
    assert clock.eta(4) == 4 * (2.25 / 3)
    for _ in range(150):
        clock.add(1.0, 1)
    assert len(clock.recent) == 100 and clock.eta(2) == 2.0  # the last 20 steps' pace
