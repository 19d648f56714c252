"""Saving and restoring a training run's checkpoints, on every process of the job alike.

The loop calls one object, the `Checkpointer`: `save` writes ckpt-{step}, points `latest` at
it and prunes all but the newest keep_last; `save_best` writes best/; `restore` puts a
checkpoint's optimizer and RNG states back. Every process calls these: FSDP gathers the
shards onto rank 0 and the RNG states of all ranks are collected (collectives); rank 0 alone
writes, and the others wait until the files are complete, so nobody runs ahead of a
checkpoint it might need. What a checkpoint folder holds is run/checkpoint.py's business
(which also owns `on_write_stage`, the crash-test hook called at every stage named in
WRITE_STAGES); which checkpoints a run keeps is run/store.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from qkvlab.run import checkpoint, guard, store
from qkvlab.run.checkpoint import Checkpoint, read_optimizer_state, write_checkpoint
from qkvlab.run.config import RunConfig
from qkvlab.run.layout import BEST_DIR, ckpt_name
from qkvlab.run.rng import rng_state, set_rng_state
from qkvlab.train.distributed import Parallel, rank_seed


class Checkpointer:
    """The checkpoints of one run folder, for the model and optimizer as this process holds
    them (`par`: plain, DDP or FSDP2-sharded)."""

    def __init__(self, run_dir: Path, cfg: RunConfig, par: Parallel,
                 optimizer: torch.optim.Optimizer):
        self.run_dir, self.cfg, self.par, self.optimizer = Path(run_dir), cfg, par, optimizer
        self.ctx = par.ctx
        store.check_latest(self.run_dir)  # before training, not at the first checkpoint

    def weights_finite(self) -> bool:
        """Whether every process's weights are finite: only such weights may be saved (ones
        with a NaN could be neither resumed nor evaluated). The same answer on every process."""
        return not self.ctx.any(not guard.weights_finite(self.par.module))

    # -- saving --------------------------------------------------------------------------------
    def save(self, step: int, state: dict[str, Any]) -> Path:
        """ckpt-{step} with the optimizer and `state` in its state.json, then `latest`, then
        pruning; the checkpoint's path on every process."""
        extra = self._rank_rngs()
        model, optim = self._full_states(with_optimizer=True)
        path = None
        if self.ctx.is_main:
            path = write_checkpoint(self.run_dir / ckpt_name(step), model, self.cfg,
                                    optimizer=optim,
                                    state={**state, **extra, "step": step, "kind": "train"})
            checkpoint.on_write_stage("checkpoint complete, latest not yet updated")
            store.point_latest(self.run_dir, path)
            checkpoint.on_write_stage("latest updated, not yet pruned")
            store.prune(self.run_dir, self.cfg.train.keep_last, keep=path)
        return self._everywhere(path)

    def save_best(self, state: dict[str, Any]) -> Path:
        """best/ (the weights without the optimizer), replacing the previous one."""
        extra = self._rank_rngs()
        model, _ = self._full_states(with_optimizer=False)
        path = None
        if self.ctx.is_main:
            path = write_checkpoint(self.run_dir / BEST_DIR, model, self.cfg,
                                    state={**state, **extra, "kind": "best"})
        return self._everywhere(path)

    def _rank_rngs(self) -> dict[str, Any]:
        # per-rank RNGs (dropout): an exact resume on the same world size restores each
        return {"rng_ranks": self.ctx.gather(rng_state())} if self.ctx.enabled else {}

    def _everywhere(self, path: Path | None) -> Path:
        """Rank 0's path on every process; the others wait here until it is written."""
        return Path(self.ctx.broadcast(str(path) if path is not None else None))

    def _full_states(self, with_optimizer: bool
                     ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any] | None]:
        """(model, optimizer) state dicts, whole and numbered as one process numbers them, on
        rank 0; (None, None) on the others."""
        if self.par.mode != "fsdp":  # every rank holds the full, identical state
            if not self.ctx.is_main:
                return None, None
            optim = self.optimizer.state_dict() if with_optimizer else None
            return self.par.module.state_dict(), optim
        # FSDP only, like Parallel._shard's imports
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        # full_state_dict + cpu_offload: rank 0 receives whole CPU tensors, the others nothing
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.par.module, options=opts)
        osd = get_optimizer_state_dict(self.par.module, self.optimizer, options=opts) \
            if with_optimizer else None
        if not self.ctx.is_main:
            return None, None
        return model, (by_index(osd) if osd is not None else None)

    # -- restoring -----------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> None:
        """The optimizer and RNG states of `ckpt`, written by any world size and mode.

        The weights are not loaded here: they go into the whole model before it is wrapped
        (FSDP shards the parameters that exist at that moment), see train/session.py.
        """
        self._load_optimizer(ckpt)
        self._restore_rng(ckpt)

    def _load_optimizer(self, ckpt: Checkpoint) -> None:
        # DTensor shapes are the whole parameters' (what the checkpoint holds), as are plain ones
        shapes = [tuple(p.shape) for g in self.optimizer.param_groups for p in g["params"]]
        sd = read_optimizer_state(ckpt, self.optimizer.state_dict(), shapes)
        if self.par.mode != "fsdp":
            self.optimizer.load_state_dict(sd)
            return
        # FSDP only, like Parallel._shard's imports
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        names = {id(p): n for n, p in self.par.module.named_parameters()}
        fqns = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        # every process passes the full state and keeps its own shard of it
        set_optimizer_state_dict(self.par.module, self.optimizer, by_name(sd, fqns),
                                 options=StateDictOptions(full_state_dict=True))

    def _restore_rng(self, ckpt: Checkpoint) -> None:
        """Each rank's RNG state of a checkpoint, when it was saved with this world size."""
        ranks, rank = ckpt.state.get("rng_ranks"), self.ctx.rank
        if isinstance(ranks, list) and len(ranks) == self.ctx.world_size:
            set_rng_state(ranks[rank])
        elif self.ctx.is_main:
            set_rng_state(ckpt.state["rng"])
        else:
            # another world size: this rank had no stream of its own, so start a fresh one
            torch.manual_seed(rank_seed(self.cfg.train.seed + ckpt.step, rank))


def by_index(osd: dict[str, Any]) -> dict[str, Any]:
    """A fully-qualified-name keyed optimizer state dict -> optimizer.state_dict()'s layout.

    Indices run over the parameter groups in order, exactly as a plain optimizer numbers them,
    so the checkpoint is the one a single process would write.
    """
    index: dict[str, int] = {}
    groups = []
    for group in osd["param_groups"]:
        ids = []
        for fqn in group["params"]:
            index.setdefault(fqn, len(index))
            ids.append(index[fqn])
        groups.append({**group, "params": ids})
    return {"state": {index[k]: v for k, v in osd["state"].items()}, "param_groups": groups}


def by_name(sd: dict[str, Any], fqns: list[str]) -> dict[str, Any]:
    """by_index's inverse: an optimizer.state_dict() keyed by the names `fqns` (index order)."""
    return {
        "state": {fqns[int(i)]: s for i, s in sd["state"].items()},
        "param_groups": [{**g, "params": [fqns[int(i)] for i in g["params"]]}
                         for g in sd["param_groups"]],
    }
