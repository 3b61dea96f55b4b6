"""The BERT demo's phase 1, built once and reused: ``make bert-phase1`` (its last line is the run's directory).

Phase 2 (``make demo``) starts from a LAMB phase-1 checkpoint past the loss plateau, as KAISA's BERT result
does. This script trains phase 1 (``configs/bert_cpu_phase1_lamb.json`` through the ``deepspeed`` launcher on 2
ranks) into ``<out>/<key>/`` unless that run is already complete, then prints the directory, which holds
``checkpoints/`` (the final step), ``tokenizer/`` and ``metrics.csv``; ``pretrain.py --init-checkpoint <dir>``
takes both the weights and the tokenizer from it. The key hashes what determines the checkpoint: the config, the
corpus digest, the code that trains (:func:`code_files`: the example, the LAMB optimizer and how
``ds_kfac.initialize`` builds it), the seed and the versions of torch, transformers, tokenizers and DeepSpeed. Everything else it
and the launcher print goes to stderr, so ``$(python examples/bert/phase1.py)`` captures the path alone.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import corpora  # noqa: E402

from ds_kfac.integration.cleanup import run_launcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "bert_cpu_phase1_lamb.json"
COMPLETE = "phase1-complete.json"
EXAMPLE_FILES = (
    *("pretrain.py", "recipe.py", "faults.py", "corpora.py", "wordpiece.py", "pairing.py", "masking.py"),
    *("sources.py", "corpus.py", "prepare.py", "out_dir.py", "shard_jobs.py", "shards.py", "loading.py", "run_data.py"),
)
"""The example's modules phase 1 runs: its loop and config, and the embedded corpus's way into shards and batches
(not ``nvidia.py``, which only ``--nvidia-hdf5`` imports)."""
"""Written into the run's directory when it finished: a directory without it is rebuilt."""


def code_files(root: Path) -> list[Path]:
    """The code under ``root`` whose change makes a new phase 1. Phase 1 is plain DeepSpeed with a JSON ``Lamb``,
    so it runs the example's training loop and data (:data:`EXAMPLE_FILES`), ``ds_kfac.initialize``'s
    building of that optimizer (``initialize.py``, ``integration/optimizer_setup.py``: which class, for which
    device), and the LAMB it resolves to (``optimizers/resolve.py``, ``optimizers/lamb.py``) with the ds_kfac
    modules those two import (:func:`ds_kfac_imports`). Not the other optimizers (Muon, the client optimizers), nor
    the K-FAC engine that ``initialize.py`` imports but a config without ``"kfac"`` never builds: an edit there
    must not retrain a 14-minute phase 1."""
    lamb = ds_kfac_imports([root / "ds_kfac" / "optimizers" / name for name in ("lamb.py", "resolve.py")], root)
    example = [root / "examples" / "bert" / name for name in EXAMPLE_FILES]
    building = [root / "ds_kfac" / "integration" / name for name in ("initialize.py", "optimizer_setup.py")]
    return [*example, *building, *lamb]


def ds_kfac_imports(modules: list[Path], root: Path) -> list[Path]:
    """``modules`` and, transitively, every ``ds_kfac`` module under ``root`` they import (at any depth of the
    file, relative or absolute; a package as its ``__init__.py``), sorted. Read from the source, not from
    ``sys.modules``, whose list depends on what else was imported."""
    found, todo = set(), list(modules)
    while todo:
        path = todo.pop()
        if path in found:
            continue
        found.add(path)
        package = path.parent.relative_to(root).parts
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else ()
                module = tuple(part for part in (*base, *(node.module or "").split(".")) if part)
                names = [module] if node.module else []
                names += [(*module, alias.name) for alias in node.names]  # an imported name may be a module
            elif isinstance(node, ast.Import):
                names = [tuple(alias.name.split(".")) for alias in node.names]
            else:
                continue
            for parts in names:
                if parts[:1] != ("ds_kfac",):
                    continue
                module = root.joinpath(*parts)
                todo += [p for p in (module.with_suffix(".py"), module / "__init__.py") if p.is_file()]
    return sorted(found)


def key(config: Path, cache: Path, seed: int) -> str:
    """The hash of everything that determines the phase-1 checkpoint (builds the corpus into ``cache``, or reads
    it from there)."""
    import deepspeed
    import tokenizers
    import torch
    import transformers

    settings = json.loads(config.read_text())
    model = ROOT / settings.get("bert", {}).get("model", "configs/bert/bert-tiny.json")
    digest = hashlib.sha256()
    for path in [config, model, *code_files(ROOT)]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    documents = corpora.embedded_corpus("packages", cache_dir=cache / "corpus-cache")
    versions = [torch.__version__, transformers.__version__, tokenizers.__version__, deepspeed.__version__]
    digest.update(json.dumps([corpora.corpus_digest(documents), seed, versions]).encode())
    return digest.hexdigest()[:16]


def build(out: Path, cache: Path, config: Path, seed: int, timeout: float) -> Path:
    """The phase-1 run of ``config``: reused when complete, else trained (a partial one is removed first)."""
    run = out / key(config, cache, seed)
    if (run / COMPLETE).is_file():
        print(f"phase 1: reusing {run}", file=sys.stderr)
        return run
    shutil.rmtree(run, ignore_errors=True)
    print(f"phase 1: training {config.name} into {run} (once; reused while its key holds)", file=sys.stderr)
    port = str(_free_port())
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port", port]
    cmd += [str(ROOT / "examples" / "bert" / "pretrain.py"), "--deepspeed_config", str(config)]
    cmd += ["--output-dir", str(out), "--run-name", run.name, "--cache-dir", str(cache), "--seed", str(seed)]
    code = run_launcher(cmd, port, timeout, cwd=ROOT, output=sys.stderr, env={"OMP_NUM_THREADS": "1"})
    if code != 0:
        raise RuntimeError(f"phase 1 {f'timed out after {timeout:.0f}s' if code is None else f'exited {code}'}")
    steps = json.loads(config.read_text())["bert"]["max_steps"]
    if not (run / "checkpoints" / f"step{steps}").is_dir() or not (run / "tokenizer").is_dir():
        raise RuntimeError(f"phase 1 finished without its checkpoint step{steps} or tokenizer in {run}")
    where = config.relative_to(ROOT) if config.is_relative_to(ROOT) else config  # a benchmark's config under --out
    (run / COMPLETE).write_text(json.dumps({"config": str(where), "seed": seed}) + "\n")
    return run


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bert-phase1")
    parser.add_argument("--cache-dir", type=Path, default=ROOT / "runs" / "bert-cache")
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the phase-1 run")
    args = parser.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # what DeepSpeed and the corpus print goes to stderr
        run = build(args.out, args.cache_dir, args.config.resolve(), args.seed, args.timeout)
    print(run)


if __name__ == "__main__":
    main()
