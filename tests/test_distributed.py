"""Multi-process training: the batch plan, and 2-process gloo runs against a single process.

The end-to-end tests launch `torchrun --nproc_per_node=2 -m qkvlab train` exactly as a user
would (gloo on the CPU) and compare metrics.jsonl with an in-process single-process run of the
same config: the global batch does not depend on the world size, so the losses must agree up to
float summation order (1e-5), through checkpoints and resumes in either direction.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from helpers import tiny_config
from qkvlab.data.loader import TokenData
from qkvlab.errors import QkvlabError
from qkvlab.run.config import RESUME_HARMLESS, save_config
from qkvlab.run.metrics import read_metrics
from qkvlab.train.checkpointer import by_index, by_name
from qkvlab.train.distributed import BatchPlan, plan_batches
from qkvlab.train.trainer import train

TOL = 1e-5
needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


def config(data_dir: Path, out: Path, *extra: str):
    """A 2 x 32 model, context 16, fp32, no dropout: 8 sequences per optimizer step.

    2 x 4 micro-batches: on 2 processes each runs 2 micro-steps, the first without a sync.
    """
    return tiny_config(
        data_dir, "optim.decay_steps=8", "train.batch_size=2", "train.grad_accum=4",
        # 10 windows in batches of 4: 3 eval batches, so one rank of two runs a padding batch
        "train.eval_windows=10", "train.eval_batch_size=4", f"run.out_dir={out}", *extra,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(cfg, tmp_path: Path, *args: str, nproc: int = 2, ok: bool = True) -> str:
    """`torchrun --nproc_per_node=nproc -m qkvlab train CFG ARGS`; returns its output."""
    cfg_file = tmp_path / f"cfg-{free_port()}.toml"
    save_config(cfg, cfg_file)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           "-m", "qkvlab", "train", str(cfg_file), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out[-4000:]
    return out


def curve(run_dir: Path) -> list[tuple[int, float | None, float | None]]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in read_metrics(run_dir)]


def max_diff(a: Path, b: Path) -> float:
    """max |difference| of train and val losses, after checking both logged the same steps."""
    ca, cb = curve(a), curve(b)
    assert [c[0] for c in ca] == [c[0] for c in cb]
    diffs = [0.0]
    for x, y in zip(ca, cb, strict=True):
        for i in (1, 2):
            assert (x[i] is None) == (y[i] is None), (x, y)
            if x[i] is not None:
                diffs.append(abs(x[i] - y[i]))
    return max(diffs)


@pytest.fixture(scope="module")
def single(data_dir, tmp_path_factory) -> Path:
    """The reference: one process, 8 steps, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("single") / "run"
    train(config(data_dir, out), quiet=True)
    return out


# ---- the batch plan ---------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["random", "shuffled"])
@pytest.mark.parametrize("batch_size,grad_accum,world", [
    (4, 2, 1), (4, 2, 2), (4, 1, 2), (4, 1, 4), (6, 4, 8), (8, 6, 4), (3, 4, 2), (12, 40, 8),
])
def test_plan_deals_out_the_single_process_batch(data_dir, batch_size, grad_accum, world,
                                                 order):
    """Every rank's windows together are exactly the single-process global batch, disjoint."""
    data = TokenData(data_dir)
    step, seed, block = 5, 7, 8
    batch = functools.partial(data.train_batch, order=order, grad_accum=grad_accum)
    single = {m: batch(step, m, batch_size, block, seed)[0] for m in range(grad_accum)}
    got: dict[int, list[tuple[int, torch.Tensor]]] = {m: [] for m in range(grad_accum)}
    for rank in range(world):
        plan = plan_batches(batch_size, grad_accum, world, rank)
        assert len(plan.micro_steps()) * plan.rows_per_micro_step * world == \
            batch_size * grad_accum  # the same work on every rank
        for micro in plan.micro_steps():
            x, _ = batch(step, micro.index, micro.rows, block, seed, micro.part, micro.parts)
            got[micro.index].append((micro.part, x))
    for m, parts in got.items():
        assert sorted(p for p, _ in parts) == list(range(len(parts)))  # each slice once
        joined = torch.cat([x for _, x in sorted(parts, key=lambda t: t[0])])
        assert torch.equal(joined, single[m])


def test_plan_is_the_plain_loop_on_one_process():
    plan = BatchPlan(batch_size=12, grad_accum=40, world_size=1, rank=0)
    assert [(m.index, m.rows, m.part, m.parts) for m in plan.micro_steps()] == \
        [(m, 12, 0, 1) for m in range(40)]
    # the paper's 12 x 40 on 8 GPUs: 5 whole micro-steps each, nanoGPT's split
    plan8 = plan_batches(12, 40, 8, 3)
    assert [m.index for m in plan8.micro_steps()] == [15, 16, 17, 18, 19]
    assert plan8.rows_per_micro_step == 12


def test_plan_refuses_an_indivisible_batch():
    with pytest.raises(QkvlabError, match=r"grad_accum a multiple of 8 or train.batch_size a "
                                          r"multiple of 8"):
        plan_batches(4, 1, 8, 0)


def test_fsdp_optimizer_state_is_renumbered_like_a_plain_optimizer():
    t = torch.zeros(2)
    osd = {"state": {"b": {"exp_avg": t}, "a": {"exp_avg": t}, "c": {"exp_avg": t}},
           "param_groups": [{"params": ["a", "b"], "lr": 1.0}, {"params": ["c"], "lr": 2.0}]}
    out = by_index(osd)
    assert sorted(out["state"]) == [0, 1, 2]
    assert [g["params"] for g in out["param_groups"]] == [[0, 1], [2]]
    assert out["param_groups"][1]["lr"] == 2.0
    # and back, as an FSDP resume hands the state to set_optimizer_state_dict
    back = by_name(out, ["a", "b", "c"])
    assert back["param_groups"] == osd["param_groups"]
    assert {k: v["exp_avg"] is osd["state"][k]["exp_avg"] for k, v in back["state"].items()} \
        == {"a": True, "b": True, "c": True}


def test_parallel_key_is_validated_and_harmless_on_resume(data_dir, tmp_path):
    with pytest.raises(QkvlabError, match="train.parallel"):
        config(data_dir, tmp_path, "train.parallel=zero3")
    assert "train.parallel" in RESUME_HARMLESS


def _sync_worker(rank: int, port: int, mode: str, out_dir: str) -> None:
    """One of 2 gloo processes: record, after each micro-step, what reached the other rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from qkvlab.model import GPT
        from qkvlab.model.config import ModelConfig
        from qkvlab.train.distributed import DistContext, Parallel

        torch.manual_seed(0)
        cfg = ModelConfig.from_dict({"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16,
                                     "vocab_size": 65}, where="model")
        par = Parallel(GPT(cfg), DistContext(torch.device("cpu"), rank, 2), mode, False,
                       plan_batches(2, 4, 2, rank))  # 2 micro-steps per rank
        reduced: list[int] = []
        if mode == "ddp":
            def hook(state, bucket):  # DDP's own all-reduce, counted
                reduced.append(1)
                fut = dist.all_reduce(bucket.buffer().div_(2), async_op=True).get_future()
                return fut.then(lambda f: f.value()[0])

            par.wrapped.register_comm_hook(None, hook)
        record = []
        micros = par.micro_steps()
        for i, _ in enumerate(micros):
            x = torch.randint(0, 65, (2, 16))
            with par.grad_sync(i == len(micros) - 1):
                _, loss = par.fwd(x, x)
                loss.backward()
            # DDP: bucket all-reduces so far; FSDP2: parameters holding a reduced (sharded)
            # gradient, which only a syncing backward produces
            record.append(len(reduced) if mode == "ddp" else
                          sum(p.grad is not None for p in par.module.parameters()))
        Path(out_dir, f"{mode}-{rank}.json").write_text(json.dumps(record))
    finally:
        from qkvlab.train.distributed import _let_workers_finish

        dist.destroy_process_group()
        _let_workers_finish()  # else gloo's threads may abort the exit (see session())


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_no_gradient_sync_before_the_last_micro_step(mode, tmp_path):
    torch.multiprocessing.spawn(_sync_worker, args=(free_port(), mode, str(tmp_path)), nprocs=2)
    for rank in range(2):
        first, last = json.loads((tmp_path / f"{mode}-{rank}.json").read_text())
        assert first == 0, f"{mode} rank {rank} synced gradients on a non-final micro-step"
        assert last > 0, f"{mode} rank {rank} never synced gradients"


# ---- 2 processes against 1 -------------------------------------------------------------------
@pytest.mark.slow
@needs_gloo
def test_two_process_ddp_matches_single_and_resumes(data_dir, single, tmp_path):
    run = tmp_path / "ddp"
    # 4 steps (ckpt-0000004), then resume to 8 on 2 processes and, from a copy, on 1 process
    out = torchrun(config(data_dir, run, "train.max_steps=4"), tmp_path)
    assert out.count("done at step 4") == 1  # rank 0 speaks for the job
    state = json.loads((run / "ckpt-0000004/state.json").read_text())
    assert state["world_size"] == 2 and state["parallel"] == "ddp"
    assert len(state["rng_ranks"]) == 2
    assert state["data_stream"]["next_step"] == 4
    assert state["data_stream"]["micro_steps_per_rank"] == 2
    shutil.copytree(run, tmp_path / "ddp-to-1")
    torchrun(config(data_dir, run), tmp_path, "--resume")
    train(config(data_dir, tmp_path / "ddp-to-1"), resume=True, quiet=True)

    d_ddp, d_to_1 = max_diff(single, run), max_diff(single, tmp_path / "ddp-to-1")
    print(f"max |loss diff| single vs 2-proc DDP (+resume): {d_ddp:.3g}; "
          f"2-proc then resumed on 1: {d_to_1:.3g}")
    assert d_ddp < TOL and d_to_1 < TOL
    assert len(read_metrics(run)) == 9  # steps 0..8 once each: only rank 0 writes
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    # the final long val loss, its batches dealt out over the processes, is the single one's
    one = json.loads((single / "summary.json").read_text())["final_val_loss_long"]
    two = summary["final_val_loss_long"]
    assert two["tokens"] == one["tokens"] > 0 and abs(two["loss"] - one["loss"]) < TOL
    assert sorted(p.name for p in run.glob("ckpt-*")) == ["ckpt-0000004", "ckpt-0000008"]
    # the weights agree too, not only the losses
    from safetensors.torch import load_file

    a = load_file(single / "ckpt-0000008/model.safetensors")
    b = load_file(run / "ckpt-0000008/model.safetensors")
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < TOL


@pytest.mark.slow
@needs_gloo
def test_two_process_row_split_matches_single(data_dir, tmp_path):
    """grad_accum = 1 on 2 processes: each takes half the rows of the one micro-batch."""
    shape = ("train.batch_size=4", "train.grad_accum=1", "train.max_steps=4")
    torchrun(config(data_dir, tmp_path / "ddp", *shape), tmp_path)
    train(config(data_dir, tmp_path / "one", *shape), quiet=True)
    d = max_diff(tmp_path / "one", tmp_path / "ddp")
    print(f"max |loss diff| single vs 2-proc row split: {d:.3g}")
    assert d < TOL


@pytest.mark.slow
@needs_gloo
def test_two_process_fsdp_matches_single_and_resumes(data_dir, single, tmp_path):
    """FSDP2 (fully_shard) on gloo: gathered checkpoints, sharded optimizer resume."""
    run = tmp_path / "fsdp"
    torchrun(config(data_dir, run, "train.parallel=fsdp", "train.max_steps=4"), tmp_path)
    # the gathered checkpoint is an ordinary full one: the single run's, to float order
    from safetensors.torch import load_file

    for name in ("model", "optimizer"):
        a = load_file(single / f"ckpt-0000004/{name}.safetensors")
        b = load_file(run / f"ckpt-0000004/{name}.safetensors")
        assert a.keys() == b.keys(), name
        assert all(a[k].shape == b[k].shape for k in a)
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < TOL, name
    torchrun(config(data_dir, run, "train.parallel=fsdp"), tmp_path, "--resume")
    d = max_diff(single, run)
    print(f"max |loss diff| single vs 2-proc FSDP (+resume): {d:.3g}")
    assert d < TOL
    assert json.loads((run / "ckpt-0000008/state.json").read_text())["parallel"] == "fsdp"


@pytest.mark.slow
@needs_gloo
def test_two_process_refusal_is_one_line_not_a_hang(data_dir, tmp_path):
    """3 rows x 1 micro-batch cannot be split over 2 processes: every rank says so and exits."""
    out = torchrun(config(data_dir, tmp_path / "odd", "train.batch_size=3", "train.grad_accum=1"),
                   tmp_path, ok=False)
    assert out.count("qkvlab train: error: the global batch (train.batch_size = 3 x "
                     "train.grad_accum = 1) cannot be split evenly over 2 processes") == 2
    assert not (tmp_path / "odd" / "metrics.jsonl").exists()


def test_single_process_checkpoint_records_world_size_one(data_dir, single):
    state = json.loads((single / "ckpt-0000004/state.json").read_text())
    assert state["world_size"] == 1 and "rng_ranks" not in state
    assert state["data_stream"]["global_batch_sequences"] == 8
    assert np.isclose(state["tokens"], 4 * 8 * 16)
