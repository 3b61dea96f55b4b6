"""The BERT demo's phase 1, built once and reused: ``make bert-phase1`` (its last line is the run's directory).

Phase 2 (``make demo``) starts from a LAMB phase-1 checkpoint past the loss plateau, as KAISA's BERT result
does. This script trains phase 1 (``configs/bert_cpu_phase1_lamb.json`` through the ``deepspeed`` launcher on 2
ranks) into ``<out>/<key>/`` unless that run is already complete, then prints the directory, which holds
``checkpoints/`` (the final step), ``tokenizer/`` and ``metrics.csv``; ``pretrain.py --init-checkpoint <dir>``
takes both the weights and the tokenizer from it. The key hashes what determines the checkpoint: the config, the
corpus digest, the code that trains (``examples/bert/pretrain.py`` and ``data.py``, ``ds_kfac``'s optimizers and
``initialize``), the seed and the versions of torch, transformers, tokenizers and DeepSpeed. Everything else it
and the launcher print goes to stderr, so ``$(python examples/bert/phase1.py)`` captures the path alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import data  # noqa: E402

from ds_kfac.integration.cleanup import run_launcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "bert_cpu_phase1_lamb.json"
CODE = [
    ROOT / "examples" / "bert" / "pretrain.py",
    ROOT / "examples" / "bert" / "data.py",
    *sorted((ROOT / "ds_kfac" / "optimizers").glob("*.py")),
    ROOT / "ds_kfac" / "integration" / "initialize.py",
]
"""The code whose change makes a new phase 1 (the training loop, the data, the optimizer that trains it)."""
COMPLETE = "phase1-complete.json"
"""Written into the run's directory when it finished: a directory without it is rebuilt."""


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
    for path in [config, model, *CODE]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    documents = data.embedded_corpus("packages", cache_dir=cache / "corpus-cache")
    versions = [torch.__version__, transformers.__version__, tokenizers.__version__, deepspeed.__version__]
    digest.update(json.dumps([data.corpus_digest(documents), seed, versions]).encode())
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
