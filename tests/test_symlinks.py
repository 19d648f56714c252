"""A folder qkvlab writes into or copies out of holds its own files: a symbolic link that leads
out of it is refused (one line, exit 2) before anything is written, on every command that writes
or copies (train, resume, export, import-hf, archive, convert, retrofit), and whatever the link
points to is left byte-identical."""

import os
import shutil
from pathlib import Path

import pytest

from helpers import refused, tiny_overrides
from qkvlab.cli import main
from qkvlab.errors import QkvlabError
from qkvlab.fsutil import check_inside, check_tree, read_tree_inside
from qkvlab.run.layout import CONFIG_FILE, METRICS_FILE, TOKENIZER_DIR

NOTES = b"my notes, no trailing newline"  # tolerated as a torn last line by the metrics reader


def train_args(data_dir: Path, out: Path, *extra: str, changes: tuple[str, ...] = ()
               ) -> list[str]:
    sets = [a for s in tiny_overrides(data_dir, "train.max_steps=4", *changes)
            for a in ("--set", s)]
    return ["train", "shakespeare-char", *sets, "--out", str(out), *extra]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under `path` (or `path` itself) by relative name, with its bytes."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {p.relative_to(path).as_posix(): p.read_bytes()
            for p in sorted(path.rglob("*")) if p.is_file()}


def outside_file(tmp_path: Path) -> Path:
    path = tmp_path / "outside" / "notes.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(NOTES)
    return path


def outside_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "outside-dir"
    folder.mkdir()
    (folder / "meta.json").write_bytes(b'{"mine": true}')
    (folder / "char_vocab.json").write_bytes(b"private")
    return folder


def assert_refused_naming(capsys, args: list[str], link: Path) -> str:
    err = refused(capsys, args)
    assert "symbolic link" in err and link.name in err
    return err


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    """A finished tiny run (4 steps, fp32, GPT-2 style so it exports): copy it before
    changing anything."""
    run = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_args(data_dir, run)) == 0
    return run


@pytest.fixture(scope="module")
def convertible(data_dir, tmp_path_factory) -> Path:
    """A finished tiny run that converts exactly (no norm, skips around attention only)."""
    run = tmp_path_factory.mktemp("convertible") / "run"
    assert main(train_args(data_dir, run, changes=("model.norm=none",
                                                   "model.residual=attention"))) == 0
    return run


@pytest.fixture(scope="module")
def sweep(data_dir, tmp_path_factory) -> Path:
    """A finished one-run sweep."""
    folder = tmp_path_factory.mktemp("sweep")
    spec = folder / "one.toml"
    sets = ", ".join(f'"{s}"' for s in tiny_overrides(data_dir, "train.max_steps=4"))
    spec.write_text(f'[spec]\nname = "one"\nbase = "shakespeare-char"\nset = [{sets}]\n'
                    'seeds = [1]\n\n[[variant]]\nname = "baseline"\nbaseline = true\n'
                    'rule = "baseline"\n', encoding="utf-8")
    out = folder / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    return out


def copy_of(src: Path, tmp_path: Path, name: str = "run") -> Path:
    dest = tmp_path / name
    shutil.copytree(src, dest)
    return dest


def link_file_out(folder: Path, name: str, target: Path) -> Path:
    link = folder / name
    link.unlink(missing_ok=True)
    link.symlink_to(target)
    return link


# ---- train and resume ----------------------------------------------------------------------
@pytest.mark.parametrize("name", [METRICS_FILE, CONFIG_FILE, "summary.json", "latest"])
@pytest.mark.parametrize("resume", [False, True])
def test_train_refuses_a_run_file_linked_outside(data_dir, tmp_path, capsys, name, resume):
    notes = outside_file(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    link = link_file_out(run, name, notes)
    args = train_args(data_dir, run, *(["--resume"] if resume else []))
    assert_refused_naming(capsys, args, link)
    assert notes.read_bytes() == NOTES
    assert sorted(os.listdir(run)) == [name]  # nothing written, the link left as it was
    assert link.is_symlink()


@pytest.mark.parametrize("name", [TOKENIZER_DIR, "tb", "best"])
def test_train_refuses_a_run_folder_linked_outside(data_dir, tmp_path, capsys, name):
    target = outside_dir(tmp_path)
    before = snapshot(target)
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(target, target_is_directory=True)
    assert_refused_naming(capsys, train_args(data_dir, run, "--set", "train.tensorboard=true"),
                          run / name)
    assert snapshot(target) == before and sorted(os.listdir(target)) == sorted(before)
    assert sorted(os.listdir(run)) == [name]


def test_resume_refuses_a_linked_metrics_file_of_a_trained_run(data_dir, trained, tmp_path,
                                                               capsys):
    run = copy_of(trained, tmp_path)
    notes = outside_file(tmp_path)
    link = link_file_out(run, METRICS_FILE, notes)
    before = snapshot(run / CONFIG_FILE)
    args = train_args(data_dir, run, "--resume", "--set", "train.max_steps=8")
    assert_refused_naming(capsys, args, link)
    assert notes.read_bytes() == NOTES and snapshot(run / CONFIG_FILE) == before


def test_a_link_that_stays_inside_the_run_is_allowed(data_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_bytes(NOTES)
    (run / "shortcut").symlink_to("notes.txt")
    assert main(train_args(data_dir, run)) == 0
    assert (run / "notes.txt").read_bytes() == NOTES


# ---- copies out of a folder ----------------------------------------------------------------
def test_export_refuses_a_tokenizer_file_linked_outside(trained, tmp_path, capsys):
    run = copy_of(trained, tmp_path)
    secret = outside_file(tmp_path)
    link = link_file_out(run / TOKENIZER_DIR, "char_vocab.json", secret)
    out = tmp_path / "hf"
    assert_refused_naming(capsys, ["export", str(run), str(out)], link)
    assert not out.exists() and secret.read_bytes() == NOTES


def test_export_refuses_a_tokenizer_folder_linked_outside(trained, tmp_path, capsys):
    run = copy_of(trained, tmp_path)
    target = outside_dir(tmp_path)
    shutil.copytree(run / TOKENIZER_DIR, target, dirs_exist_ok=True)
    before = snapshot(target)
    shutil.rmtree(run / TOKENIZER_DIR)
    (run / TOKENIZER_DIR).symlink_to(target, target_is_directory=True)
    out = tmp_path / "hf"
    assert_refused_naming(capsys, ["export", str(run), str(out)], run / TOKENIZER_DIR)
    assert not out.exists() and snapshot(target) == before


def test_import_hf_refuses_a_tokenizer_file_linked_outside(trained, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", str(trained), str(hf), "--no-verify"]) == 0
    secret = outside_file(tmp_path)
    link = link_file_out(hf / "qkvlab_tokenizer", "char_vocab.json", secret)
    out = tmp_path / "imported"
    assert_refused_naming(capsys, ["import-hf", str(hf), "--out", str(out)], link)
    assert not out.exists() and secret.read_bytes() == NOTES
    assert not list(tmp_path.glob(".tmp-import-*"))


def test_archive_refuses_a_run_record_linked_outside(sweep, tmp_path, capsys):
    src = copy_of(sweep, tmp_path, "sweep")
    secret = outside_file(tmp_path)
    link = link_file_out(src / "baseline" / "seed-1", METRICS_FILE, secret)
    dest = tmp_path / "archived"
    assert_refused_naming(capsys, ["archive", str(src), str(dest)], link)
    assert not dest.exists() and secret.read_bytes() == NOTES


def test_archive_refuses_to_copy_over_a_link_in_the_destination(sweep, tmp_path, capsys):
    dest = tmp_path / "archived"
    assert main(["archive", str(sweep), str(dest)]) == 0
    notes = outside_file(tmp_path)
    link = link_file_out(dest / "baseline" / "seed-1", METRICS_FILE, notes)
    assert_refused_naming(capsys, ["archive", str(sweep), str(dest)], link)
    assert notes.read_bytes() == NOTES


@pytest.mark.parametrize("command", [["convert"], ["retrofit", "--steps", "1"]])
def test_convert_and_retrofit_refuse_a_tokenizer_linked_outside(convertible, tmp_path, capsys,
                                                                 command):
    run = copy_of(convertible, tmp_path)
    secret = outside_file(tmp_path)
    link = link_file_out(run / TOKENIZER_DIR, "char_vocab.json", secret)
    before = sorted(os.listdir(run))
    assert_refused_naming(capsys, [*command, str(run)], link)
    assert sorted(os.listdir(run)) == before and secret.read_bytes() == NOTES


def test_convert_carries_a_regular_tokenizer(convertible, tmp_path):
    run = copy_of(convertible, tmp_path)
    out = tmp_path / "converted"
    assert main(["convert", str(run), "--out", str(out)]) == 0
    assert snapshot(out / TOKENIZER_DIR) == snapshot(run / TOKENIZER_DIR)


# ---- the rule itself -----------------------------------------------------------------------
def test_check_inside_follows_every_link_on_the_way(tmp_path):
    folder, outside = tmp_path / "f", tmp_path / "o"
    (folder / "sub").mkdir(parents=True)
    outside.mkdir()
    (folder / "in").symlink_to(folder / "sub", target_is_directory=True)
    (folder / "out").symlink_to(outside, target_is_directory=True)
    (folder / "dangling").symlink_to(outside / "not-yet")
    (folder / "loop").symlink_to(folder / "loop")
    check_inside(folder, folder / "in" / "new.json")
    check_inside(folder, folder / "not-yet-written.json")
    for bad in ("out/meta.json", "dangling", "loop"):
        with pytest.raises(QkvlabError, match="symbolic link"):
            check_inside(folder, folder / bad)
    with pytest.raises(QkvlabError, match="symbolic link"):
        check_tree(folder)
    check_tree(folder / "sub")
    check_tree(tmp_path / "missing")  # nothing there yet: nothing to refuse
    (folder / "sub" / "a.txt").write_bytes(b"a")
    assert read_tree_inside(folder, folder / "in") == {"a.txt": b"a"}


def test_import_hf_reads_a_hub_cache_snapshot_whose_files_link_into_its_blobs(
        trained, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert main(["export", str(trained), str(hf), "--no-verify"]) == 0
    # the hub cache's layout: models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH
    repo = tmp_path / "hub" / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    blobs.mkdir(parents=True)
    for path in sorted(hf.rglob("*")):
        if path.is_file():
            blob = blobs / f"{len(list(blobs.iterdir())):04d}"
            shutil.copyfile(path, blob)
            link = snap / path.relative_to(hf)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(Path("../" * (len(link.relative_to(repo).parts) - 1)) / "blobs"
                            / blob.name)
    out = tmp_path / "imported"
    assert main(["import-hf", str(snap), "--out", str(out)]) == 0, capsys.readouterr().err
    assert (out / TOKENIZER_DIR / "meta.json").is_file()
