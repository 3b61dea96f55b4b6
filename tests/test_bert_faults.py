"""Faults of the BERT example's data while training runs, and runs that must not go on over other data: a shard cut
short under a 2-rank run, an NVIDIA file whose compressed data is corrupt, ids outside the vocabulary, NVIDIA's
order found in O(1) per micro-batch, and ``--resume`` / phase 2 over data or a vocabulary other than the checkpoint's
(``examples/bert/{faults,shards,nvidia,pretrain}.py``)."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import launch
import pytest

pytestmark = pytest.mark.timeout(300)
transformers = pytest.importorskip("transformers")
h5py = pytest.importorskip("h5py")

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "examples/bert"))
import corpora  # noqa: E402
import faults  # noqa: E402
import loading  # noqa: E402
import masking  # noqa: E402
import nvidia  # noqa: E402
import out_dir  # noqa: E402
import prepare  # noqa: E402
import shards  # noqa: E402
from test_bert_shards import SEQ, write_nvidia_shard  # noqa: E402

VOCAB = 600


@pytest.fixture(scope="module")
def two_preparations(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same 300 documents prepared into 3 shards with seed 0 and with seed 1 (other pairs, another manifest)."""
    root = tmp_path_factory.mktemp("faults")
    (root / "text").mkdir()
    with (root / "text" / "corpus.txt").open("w") as f:
        for doc in corpora.stdlib_corpus()[:300]:
            f.write("\n".join(doc) + "\n\n")
    out = []
    for seed in (0, 1):
        settings = prepare.Settings(SEQ, held_out_fraction=0.1, seed=seed)
        source = prepare.text_dir_source(root / "text", 30_000)
        prepare.prepare(source, root / f"seed{seed}", settings, VOCAB, sample_bytes=100_000, progress=False)
        out.append(root / f"seed{seed}")
    return out[0], out[1]


@pytest.fixture(scope="module")
def hdf5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three NVIDIA training files and a test file (vocabulary 600)."""
    root = tmp_path_factory.mktemp("hdf5")
    for i, rows in enumerate([40, 48, 56]):
        write_nvidia_shard(root / f"wiki_training_{i}.hdf5", rows, SEQ, 10, VOCAB, i)
    write_nvidia_shard(root / "wiki_test_0.hdf5", 24, SEQ, 10, VOCAB, 9)
    return root


def small_config(tmp_path: Path, name: str = "bert_cpu_phase2_base.json") -> Path:
    """A shipped config at micro-batch 8, accumulation 2, a 600-token vocabulary."""
    config = json.loads((ROOT / "configs" / name).read_text())
    config.update(train_micro_batch_size_per_gpu=8, gradient_accumulation_steps=2)
    config["bert"].update(vocab_size=VOCAB)
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def corrupt_chunk(path: Path, dataset: str = "input_ids") -> None:
    """Zero the first compressed chunk of ``dataset`` in place: the header still reads, the data no longer inflates."""
    with h5py.File(path, "r") as f:
        info = f[dataset].id.get_chunk_info(0)
    with path.open("r+b") as f:
        f.seek(info.byte_offset)
        f.write(b"\0" * info.size)


# --------------------------------------------------------------------------- where a fault is found


def test_a_shard_cut_short_under_a_run_is_a_fault_naming_it(two_preparations: tuple[Path, Path], tmp_path) -> None:
    """A pair read past the end of a shard truncated after it was opened: a :class:`faults.Fault` naming the file
    and the short read, never rows of whatever was read (before, the cut pairs came back empty: NaN losses)."""
    copy = shutil.copytree(two_preparations[0], tmp_path / "copy")
    opened = shards.ShardSet.open(copy, SEQ, VOCAB)
    tokenizer = opened.tokenizer()
    vocab, cls_id, sep_id = masking.Vocabulary.of(tokenizer), tokenizer.cls_token_id, tokenizer.sep_token_id
    batches = loading.ShardBatches(opened, vocab, cls_id, sep_id, seed=0, split="train")
    last = len(opened) - 1
    assert not isinstance(batches[(0, (0, last))], faults.Fault)  # files opened, a pair of the last shard read
    tokens = copy / opened.names[-1] / "tokens.npy"
    with tokens.open("r+b") as f:
        f.truncate(200)
    fault = batches[(0, (0, last))]
    assert isinstance(fault, faults.Fault)
    expected = rf"{re.escape(str(tokens))}: truncated after preparation \(read \d+ of \d+ bytes .*"
    assert re.fullmatch(expected, fault.message)


def test_nvidia_values_and_compression_faults_name_the_file(hdf5_dir: Path, tmp_path: Path) -> None:
    """An NVIDIA micro-batch whose ``masked_lm_ids`` or ``input_ids`` leave the vocabulary, whose masked positions
    leave the sequence, or whose compressed data is corrupt: a fault naming the file and the array (the masked ids
    were unchecked: ``IndexError: Target 5000 is out of bounds`` deep in the loss)."""
    path = tmp_path / "x_training_0.hdf5"
    arrays = write_nvidia_shard(path, 16, SEQ, 10, VOCAB, 3)
    files, _ = nvidia.discover(tmp_path, SEQ)
    assert not isinstance(nvidia.NvidiaBatches(files, VOCAB)[(-1, 0, (0, 1))], faults.Fault)
    for name, value, message in [
        ("masked_lm_ids", 5000, r"masked_lm_ids holds id 5000, the config's bert\.vocab_size is 600"),
        ("input_ids", -3, r"input_ids holds id -3, the config's bert\.vocab_size is 600"),
        ("masked_lm_positions", SEQ, rf"masked_lm_positions holds {SEQ}, outside a sequence of {SEQ}"),
    ]:
        changed = {key: array.copy() for key, array in arrays.items()}
        changed[name][1, 0] = value
        with h5py.File(path, "w") as f:
            for key, array in changed.items():
                f.create_dataset(key, data=array, compression="gzip")
        fault = nvidia.NvidiaBatches(files, VOCAB)[(-1, 0, (0, 1))]
        assert isinstance(fault, faults.Fault) and re.fullmatch(rf"{re.escape(str(path))}: {message}", fault.message)
    write_nvidia_shard(path, 16, SEQ, 10, VOCAB, 3)
    corrupt_chunk(path)
    assert nvidia.discover(tmp_path, SEQ)[0] == files  # the header still reads: only reading the data finds it
    fault = nvidia.NvidiaBatches(files, VOCAB)[(-1, 0, (0, 1))]
    assert isinstance(fault, faults.Fault) and fault.message.startswith(f"{path}: cannot read its arrays (")


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two training files, the second under a micro-batch of 8: with 4 ranks, NVIDIA's assignment gives each rank
    one of the two in every round of an epoch, so in some epochs a rank's files hold no micro-batch."""
    root = tmp_path_factory.mktemp("uneven")
    write_nvidia_shard(root / "a_training_0.hdf5", 40, SEQ, 10, VOCAB, 0)
    write_nvidia_shard(root / "a_training_1.hdf5", 5, SEQ, 10, VOCAB, 1)
    return root


@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_nvidia_order_found_directly_is_the_order_walked(hdf5_dir: Path, uneven_dir: Path, layout: str) -> None:
    """Any micro-batch asked for directly, far into later epochs and out of order, is the one a walk through every
    epoch's rounds from the start reaches (the documented assignment, simulated here), epochs whose files give a
    rank no micro-batch included (its micro-batches come from the next epoch; before, each was found by counting
    every epoch from the first again)."""
    files, _ = nvidia.discover(hdf5_dir if layout == "even" else uneven_dir, SEQ)
    for world, rank in ((1, 0), (2, 1), (5, 3)) if layout == "even" else ((4, 0), (4, 1), (4, 3)):
        walked: list[tuple[int, int]] = []  # (file, micro-batch within its round)
        for epoch in range(12):
            names = list(range(len(files)))
            random.Random(7 + epoch).shuffle(names)
            n = len(names)
            shift = world % n if world > n else 0
            for f in range(n):
                index = names[(f * world + rank + shift * f) % n]
                walked += [(epoch * n + f, index) for _ in range(files[index].rows // 8)]
        order = nvidia.NvidiaOrder(files, 8, 1, world, rank, seed=7)
        for number in [len(walked) - 1, 3, len(walked) // 2, 0, len(walked) - 7]:
            visit, index, rows = order.micro_batch(number)
            assert (visit, index) == walked[number] and len(rows) == 8 and max(rows) < files[index].rows
        visits = order.visits(len(walked) // 3)
        first = next(visits)
        assert first[:2] == walked[len(walked) // 3] and first[2] <= len(walked) // 3 < first[3]
        later = [next(visits) for _ in range(5)]
        assert [v[2] for v in later] == [v[3] for v in [first, *later[:-1]]]  # each begins where the last ended
        assert all(walked[v[2]] == v[:2] and walked[v[3] - 1] == v[:2] for v in later)


# --------------------------------------------------------------------------- every rank stops


def _metrics(run: Path) -> list[dict[str, str]]:
    path = run / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _two_ranks(config: Path, out: Path, data_args: list[str], damage=None) -> tuple[list[launch.Ended], float]:
    """``pretrain.py`` on 2 ranks for up to 400 steps; ``damage()`` is called once the run has logged 2 steps. How
    each rank ended, and when the damage was done (seconds from the launch; 0 without one)."""
    script = [str(ROOT / "examples/bert/pretrain.py"), "--deepspeed_config", str(config), *data_args]
    script += ["--output-dir", str(out), "--max-steps", "400", "--eval-batches", "1"]
    cmds, envs = launch.rank_launch(2, script)
    damaged = [0.0]
    started = time.monotonic()

    def watch() -> None:
        while time.monotonic() - started < 200:
            if len(_metrics(out / config.stem)) >= 2:
                damage()
                damaged[0] = time.monotonic() - started
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    if damage is not None:
        watcher.start()
    ended = launch.outcomes(cmds, timeout=240, rank_envs=envs, preload=True)
    if damage is not None:
        watcher.join(timeout=5)
    return ended, damaged[0]


def stopped_together(ended: list[launch.Ended], damaged: float, cause: str) -> None:
    """Every rank exited 1 within 60 s of the damage, and rank 0 wrote one error line matching ``cause``."""
    assert damaged > 0, "the run ended before the damage"
    assert [e.code for e in ended] == [1, 1], [e.output[-2000:] for e in ended]
    assert all(e.seconds - damaged < 60 for e in ended), [(e.seconds, damaged) for e in ended]
    errors = [line for line in ended[0].output.splitlines() if line.startswith("pretrain.py: error: ")]
    assert len(errors) == 1 and re.search(cause, errors[0]), errors


def test_shards_truncated_while_two_ranks_train_stop_both_naming_the_file(
    two_preparations: tuple[Path, Path], tmp_path: Path
) -> None:
    """Every ``tokens.npy`` cut short at step 2 of a 2-rank run: both ranks exit 1 within 60 s of the damage, rank
    0's stderr names a truncated file, and no loss logged is NaN (before: 113 of 120 losses NaN, exit code 0)."""
    copy = shutil.copytree(two_preparations[0], tmp_path / "copy")
    config = small_config(tmp_path)

    def truncate() -> None:
        for tokens in copy.glob("shard-*/tokens.npy"):
            with tokens.open("r+b") as f:
                f.truncate(200)

    ended, damaged = _two_ranks(config, tmp_path / "out", ["--shards", str(copy)], truncate)
    stopped_together(ended, damaged, r"shard-\d+/tokens\.npy: truncated after preparation")
    losses = [float(row["loss"]) for row in _metrics(tmp_path / "out" / config.stem)]
    assert 2 <= len(losses) < 400 and all(math.isfinite(loss) for loss in losses)


def test_a_corrupt_nvidia_file_stops_both_ranks_naming_it(hdf5_dir: Path, tmp_path: Path) -> None:
    """An NVIDIA training file whose gzip data is corrupt past a readable header: found by the first launch's one
    reading of every file (each rank a share; before, only the headers were read), both ranks exit 2 before step 1
    naming it. Corrupted while 2 ranks train on files that launch checked and stamped, it is found when a rank
    next reads it: both ranks exit 1 within 60 s, rank 0's stderr naming it (before, one rank's loader failed and
    the other waited)."""
    copy = shutil.copytree(hdf5_dir, tmp_path / "hdf5")
    corrupt_chunk(copy / "wiki_training_1.hdf5", "masked_lm_ids")
    config = small_config(tmp_path)
    ended, _ = _two_ranks(config, tmp_path / "refused", ["--nvidia-hdf5", str(copy)])
    assert [e.code for e in ended] == [2, 2], [e.output[-2000:] for e in ended]
    errors = [line for line in ended[0].output.splitlines() if line.startswith("pretrain.py: error: ")]
    assert len(errors) == 1 and "wiki_training_1.hdf5: cannot read its arrays" in errors[0], errors

    shutil.rmtree(copy)
    copy = shutil.copytree(hdf5_dir, tmp_path / "hdf5")

    def corrupt() -> None:
        for path in copy.glob("*_training_*.hdf5"):
            corrupt_chunk(path, "masked_lm_ids")

    ended, damaged = _two_ranks(config, tmp_path / "out", ["--nvidia-hdf5", str(copy)], corrupt)
    stopped_together(ended, damaged, r"wiki_training_\d\.hdf5: cannot read its arrays")


# --------------------------------------------------------------------------- what a checkpoint pins


def _pretrain(monkeypatch, capsys, *argv: str) -> tuple[int, list[str]]:
    """``pretrain.main(argv)`` as one rank of its own (a fresh port): its exit code (0 if it returned) and the
    lines it wrote to stderr starting ``pretrain.py: error``."""
    import pretrain

    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    capsys.readouterr()
    try:
        pretrain.main(list(argv))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain.py: error")]
    return code, errors


def test_resume_and_phase_2_refuse_other_data_naming_what_changed(
    one_rank: None, two_preparations: tuple[Path, Path], hdf5_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A checkpoint records its data (manifest digest or NVIDIA file list), vocabulary, sample order, seed and global
    batch: ``--resume`` over other shards or another seed, and phase 2 from weights of another vocabulary (shards'
    tokenizer against NVIDIA's ids, either way), are refused in one line naming what changed, exit 2; the same
    data resumes, and ``--new-data`` goes on on purpose."""
    first, second = two_preparations
    config = str(small_config(tmp_path))
    out = str(tmp_path / "out")
    # no loader workers: the runs are in this long-lived process, and what is pinned does not depend on them (a worker
    # forked from it once died of a segmentation fault under load, reading NVIDIA's files)
    config = [config, "--loader-workers", "0"]
    base = ["--deepspeed_config", *config, "--output-dir", out, "--eval-batches", "1", "--max-steps", "4"]
    assert _pretrain(monkeypatch, capsys, *base, "--shards", str(first), "--stop-after", "2") == (0, [])
    code, errors = _pretrain(monkeypatch, capsys, *base, "--shards", str(second), "--resume")
    assert code == 2 and len(errors) == 1, errors
    assert re.search(
        r"--resume: the checkpoint was trained on other data than this run's \(data \w+\.\.\. -> ", errors[0]
    )
    code, errors = _pretrain(monkeypatch, capsys, *base, "--shards", str(first), "--resume", "--seed", "7")
    assert code == 2 and re.search(r"\(seed 0 -> 7\)", errors[0]), errors
    assert _pretrain(monkeypatch, capsys, *base, "--shards", str(first), "--resume") == (0, [])
    run = tmp_path / "out" / "bert_cpu_phase2_base"
    assert [int(row["step"]) for row in _metrics(run)] == [1, 2, 3, 4]

    phase2 = ["--deepspeed_config", *config, "--eval-batches", "1", "--max-steps", "1", "--init-checkpoint", str(run)]
    code, errors = _pretrain(monkeypatch, capsys, *phase2, "--output-dir", str(tmp_path / "p2"), "--nvidia-hdf5",
                             str(hdf5_dir))  # fmt: skip
    assert code == 2 and re.search(r"--init-checkpoint: .*\(vocabulary tokenizer \w+\.\.\. -> NVIDIA's ids", errors[0])
    nv = ["--deepspeed_config", *config, "--eval-batches", "1", "--max-steps", "1"]
    nv += ["--output-dir", str(tmp_path / "nv")]
    assert _pretrain(monkeypatch, capsys, *nv, "--nvidia-hdf5", str(hdf5_dir)) == (0, [])
    from_nvidia = [*phase2[:-1], str(tmp_path / "nv" / "bert_cpu_phase2_base"), "--output-dir", str(tmp_path / "p3")]
    code, errors = _pretrain(monkeypatch, capsys, *from_nvidia, "--shards", str(first))
    assert code == 2 and re.search(r"\(vocabulary NVIDIA's ids, 600 tokens -> tokenizer ", errors[0]), errors
    assert _pretrain(monkeypatch, capsys, *from_nvidia, "--shards", str(first), "--new-data") == (0, [])


# --------------------------------------------------------------------------- preparation


def _text_dir(root: Path, documents: list, copies: int) -> Path:
    """``documents`` written ``copies`` times as one blank-line text file under ``root``."""
    root.mkdir(parents=True)
    with (root / "corpus.txt").open("w") as f:
        for _ in range(copies):
            for doc in documents:
                f.write("\n".join(doc) + "\n\n")
    return root


def test_a_second_preparation_into_the_same_out_is_refused_in_one_line(tmp_path: Path) -> None:
    """While a preparation holds ``--out`` (its lock), another into it is refused naming the first's process
    (before: one of the two died on a raw ``[Errno 39] Directory not empty``), and nothing of it is written."""
    text = _text_dir(tmp_path / "text", corpora.stdlib_corpus()[:200], 1)
    out = tmp_path / "out"
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    with out_dir.locked(out):
        with pytest.raises(shards.ShardError, match=rf"{re.escape(str(out))}: another preparation \(process \d+\) is"):
            prepare.prepare(prepare.text_dir_source(text, 30_000), out, settings, VOCAB, progress=False)
        assert sorted(p.name for p in out.iterdir()) == [out_dir.LOCK]
    prepare.prepare(prepare.text_dir_source(text, 30_000), out, settings, VOCAB, sample_bytes=50_000, progress=False)


def test_a_killed_preparations_tokenizer_is_not_used_for_another_corpus(tmp_path: Path, monkeypatch) -> None:
    """A preparation killed after writing its tokenizer leaves it behind: a preparation of another corpus (or other
    settings) into that directory is refused naming what differs (before, it tokenized the new corpus with the
    first's vocabulary, silently); the same preparation run again reuses it and completes."""
    documents = corpora.stdlib_corpus()
    first, second = _text_dir(tmp_path / "a", documents[:300], 1), _text_dir(tmp_path / "b", documents[300:600], 1)
    out = tmp_path / "out"
    settings = prepare.Settings(SEQ, held_out_fraction=0.1)
    quiet = {"sample_bytes": 50_000, "progress": False}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "write_shard", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare(prepare.text_dir_source(first, 30_000), out, settings, VOCAB, **quiet)
    assert (out / shards.TOKENIZER).is_dir() and not list(out.glob("shard-*"))
    monkeypatch.undo()
    for source, other, differ in [
        (second, settings, "source"),
        (first, prepare.Settings(SEQ, held_out_fraction=0.2), "settings"),
    ]:
        with pytest.raises(shards.ShardError, match=rf"tokenizer: left by a preparation of other input or settings "
                           rf"\(its {differ} differ from this command's\), not reused"):  # fmt: skip
            prepare.prepare(prepare.text_dir_source(source, 30_000), out, other, VOCAB, **quiet)
    manifest = prepare.prepare(prepare.text_dir_source(first, 30_000), out, settings, VOCAB, **quiet)
    assert manifest["totals"]["train_pairs"] > 0


def test_a_killed_worker_is_an_error_naming_its_shard_and_the_rerun_completes_as_if_never_killed(
    tmp_path: Path,
) -> None:
    """``prepare.py --workers 2`` with one worker killed (SIGKILL, as the kernel's out-of-memory killer does):
    the preparation exits non-zero within 30 s naming the shards in flight (before: ``multiprocessing.Pool`` waited
    forever); the same command run again completes with the manifest of a preparation never interrupted."""
    import signal
    import subprocess

    text = _text_dir(tmp_path / "text", corpora.stdlib_corpus(), 6)  # about 5 MB: 4 pieces of 1.2 MB
    config = small_config(tmp_path)
    command = [sys.executable, str(ROOT / "examples/bert/prepare.py"), "--text-dir", str(text), "--deepspeed_config",
               str(config), "--workers", "2", "--shard-mb", "1.2", "--tokenizer-sample-mb", "0.3"]  # fmt: skip
    started = time.monotonic()
    run = subprocess.Popen([*command, "--out", str(tmp_path / "out")], stderr=subprocess.PIPE, text=True)
    victim = None
    while victim is None and run.poll() is None and time.monotonic() - started < 120:
        try:  # a thread or child may end between the listing and the reading
            for task in Path(f"/proc/{run.pid}/task").iterdir():
                for pid in (task / "children").read_text().split():
                    if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        victim = int(pid)
        except OSError:
            pass
        time.sleep(0.05)
    assert victim is not None, "no worker seen"
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    _, err = run.communicate(timeout=60)
    assert run.returncode != 0 and time.monotonic() - killed < 30
    assert re.search(r"prepare\.py: error: a preparation worker died .* while preparing shard-\d{5} \(", err), err
    subprocess.run([*command, "--out", str(tmp_path / "out")], check=True, capture_output=True, timeout=240)
    subprocess.run([*command, "--out", str(tmp_path / "whole")], check=True, capture_output=True, timeout=240)
    assert json.loads((tmp_path / "out" / shards.MANIFEST).read_text()) == json.loads(
        (tmp_path / "whole" / shards.MANIFEST).read_text()
    )
