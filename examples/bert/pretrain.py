"""BERT pretraining (masked LM + next-sentence prediction) with DeepSpeed, LAMB and K-FAC.

Launch as any DeepSpeed script; the config file says everything about the phase::

    deepspeed --num_gpus 2 examples/bert/pretrain.py --deepspeed_config configs/bert_cpu_phase1_lamb.json
    deepspeed --num_gpus 2 examples/bert/pretrain.py --deepspeed_config configs/bert_cpu_phase2_kfac.json \\
        --init-checkpoint runs/bert/bert_cpu_phase1_lamb

On a real corpus, prepare it once (``prepare.py``: documents to tokenized sentence pairs in shards on disk), then
train from the shards, or from NVIDIA's preprocessed HDF5 shards as they are::

    python examples/bert/prepare.py --text-dir /data/wikibooks --tokenizer /data/bert-large-uncased-tokenizer \\
        --deepspeed_config configs/bert_large_phase1_kfac.json --out /data/shards/phase1 --workers 32
    deepspeed --hostfile hosts examples/bert/pretrain.py --deepspeed_config configs/bert_large_phase1_kfac.json \\
        --shards /data/shards/phase1 --output-dir runs/phase1
    deepspeed --hostfile hosts examples/bert/pretrain.py --deepspeed_config configs/bert_large_phase1_kfac.json \\
        --nvidia-hdf5 /data/hdf5_seq_len_128_max_pred_20/books_wiki_en_corpus

Besides DeepSpeed's keys, the config has a ``"bert"`` section (``recipe.py``; read here, not passed to DeepSpeed):
``model`` (a ``transformers.BertConfig`` JSON), ``max_seq_length``, ``max_steps``, ``warmup_proportion``,
``poly_power``, ``eval_every``, ``save_every``, ``vocab_size``. The learning rate follows NVIDIA's recipe:
linear warm-up, then ``(1 - progress) ** poly_power`` decay. A ``"client_optimizer"`` section (``{"class":
"pytorch_optimizer.SOAP", "params": {...}}``) replaces the ``"optimizer"`` section with any
``torch.optim.Optimizer`` (:func:`ds_kfac.optimizers.client.pop_client_optimizer`; both sections are refused),
passed to ``ds_kfac.initialize``.

Data: ``--shards`` (a directory ``prepare.py`` wrote, each rank reading (``pread``) only the pairs it trains
on; its sequence length, vocabulary and contents checked before step 1), ``--nvidia-hdf5`` (NVIDIA's shards with
their static masks, ``nvidia.py``), or by default an embedded corpus, so the script runs offline: ``--corpus
packages`` (the default) reads the docstrings of the standard library's and the installed dependencies' Python
sources (about 34k documents, 18 MB of text), ``--corpus stdlib`` the smaller one of imported standard-library
modules. The embedded corpus takes the same path as a real one: rank 0 prepares it into shards under
``<cache-dir>/shards/`` once (``--cache-dir``, default the output directory; the corpus itself is cached in
``<cache-dir>/corpus-cache``), with ``--data-seed`` (held-out split, tokenizer sample, sentence pairs) and
``--held-out-fraction``. Sample order, masks and dropout are functions of ``--seed`` and the step; reading, masking
and collation run in ``--loader-workers`` processes that prefetch micro-batches.

Each run writes ``<output-dir>/<run-name>/``: ``metrics.csv`` (every step, with the seconds the step waited on
data), ``corpus.json`` (the data's source, digest, counts), ``ranks/rank-<r>.json`` (each rank's time of its first
step, data wait and resident memory), ``tokenizer/`` (the tokenizer it used), ``checkpoints/`` (DeepSpeed checkpoints
with K-FAC state), and refreshes ``<output-dir>/summary.txt`` and ``<output-dir>/loss.png`` with every run found
there. ``--resume`` continues an interrupted run exactly (data order, masks and dropout are functions of the step);
``--init-checkpoint`` starts phase 2 from phase 1's weights with a fresh optimizer and fresh K-FAC state (given a
run directory, from its ``checkpoints/`` and with its ``tokenizer/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm
from transformers import BertConfig, BertForPreTraining

sys.path.insert(0, str(Path(__file__).parent))
import corpora  # noqa: E402
import faults  # noqa: E402
import loading  # noqa: E402
import masking  # noqa: E402
import recipe  # noqa: E402
import report  # noqa: E402
import run_data  # noqa: E402
import shards  # noqa: E402

import ds_kfac  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=Path, help="prepared shards (examples/bert/prepare.py)")
    parser.add_argument("--nvidia-hdf5", type=Path, help="a directory of NVIDIA's preprocessed HDF5 shards")
    parser.add_argument(
        "--corpus",
        choices=corpora.EMBEDDED_CORPORA,
        default="packages",
        help="the embedded corpus, used without --shards or --nvidia-hdf5: 'packages' (docstrings of the standard "
        "library's and the dependencies' sources) or 'stdlib' (the small one of imported standard-library modules)",
    )
    for flag in ("--text-dir", "--hf-dataset"):  # the old in-memory inputs, refused with the way to use them now
        parser.add_argument(flag, type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--tokenizer",
        type=Path,
        help="a saved tokenizer (save_pretrained) the shards must match; with --nvidia-hdf5, the one NVIDIA's ids come "
        "from (recorded in checkpoints, so a phase 2 on shards of it is accepted)",
    )
    parser.add_argument("--vocab-size", type=int, help="override bert.vocab_size")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bert"))
    parser.add_argument(
        "--cache-dir", type=Path, help="the embedded corpus and its prepared shards (default: the output directory)"
    )
    parser.add_argument("--run-name", help="default: the config file's name")
    parser.add_argument("--max-steps", type=int, help="override bert.max_steps")
    parser.add_argument("--eval-every", type=int, help="override bert.eval_every")
    parser.add_argument(
        "--init-checkpoint",
        type=Path,
        help="start from these weights (phase 2 from phase 1): a checkpoints directory, or a run directory, whose "
        "checkpoints/ and saved tokenizer/ are then used",
    )
    parser.add_argument("--resume", action="store_true", help="continue this run from its latest checkpoint")
    parser.add_argument(
        "--new-data",
        action="store_true",
        help="--resume on other data, seed or global batch than the checkpoint's, or --init-checkpoint from weights "
        "trained on another vocabulary, on purpose (refused otherwise)",
    )
    parser.add_argument(
        "--stop-after", type=int, help="save a checkpoint and exit after this many steps (a job's time limit)"
    )
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out micro-batches per evaluation")
    parser.add_argument("--held-out-fraction", type=float, default=0.05, help="the embedded corpus's preparation")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, data order, masks and dropout")
    parser.add_argument(
        "--data-seed",
        type=int,
        default=0,
        help="the embedded corpus's preparation: held-out split, tokenizer sample, sentence pairs (fixed across --seed)",
    )
    parser.add_argument(
        "--sample-order",
        choices=loading.ORDERS,
        help="the epochs' order of pairs (loading.py): 'keyed' (default with --shards: nothing held per pair) or "
        "'randperm' (default for the embedded corpus: the order its recorded runs drew, 4 bytes a pair)",
    )
    parser.add_argument(
        "--verify-data",
        action="store_true",
        help="check every shard's contents against the manifest, not only those no verification stamp covers",
    )
    parser.add_argument("--loader-workers", type=int, default=1, help="processes reading and collating micro-batches")
    parser.add_argument("--prefetch", type=int, default=4, help="micro-batches each loader worker makes ahead")
    parser.add_argument("--local_rank", type=int, default=-1)
    ds_kfac.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required")
    old = "--text-dir" if args.text_dir is not None else "--hf-dataset" if args.hf_dataset is not None else None
    if old is not None:
        parser.error(
            f"{old} is prepared once, then trained on: python examples/bert/prepare.py {old} "
            f"{args.text_dir or args.hf_dataset} --deepspeed_config {args.deepspeed_config} --out SHARDS, then "
            f"pretrain.py --shards SHARDS"
        )
    if args.shards is not None and args.nvidia_hdf5 is not None:
        parser.error("give --shards or --nvidia-hdf5, not both")
    if args.loader_workers < 0 or args.prefetch < 1:
        parser.error("--loader-workers must be >= 0 and --prefetch >= 1")
    if args.init_checkpoint is not None and (args.init_checkpoint / "checkpoints").is_dir():
        run_dir = args.init_checkpoint
        args.init_checkpoint = run_dir / "checkpoints"
        if args.tokenizer is None and args.nvidia_hdf5 is None and (run_dir / "tokenizer").is_dir():
            args.tokenizer = run_dir / "tokenizer"  # NVIDIA's ids are not of it: phase 2 checks the vocabulary
    return args


def poly_warmup(max_steps: int, warmup_proportion: float, power: float):
    """NVIDIA's BERT schedule: linear warm-up, then polynomial decay to 0 at ``max_steps``."""
    warmup = max(1, int(warmup_proportion * max_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, 1.0 - (step - warmup) / max(1, max_steps - warmup)) ** power

    return factor


def build_engine(
    model: torch.nn.Module, config: dict[str, Any], schedule: Callable[[int], float], seed: int
) -> Any:
    """``ds_kfac.initialize`` on BERT as NVIDIA's recipe groups its parameters (no weight decay on biases and
    LayerNorms), with the config's optimizer (or its ``"client_optimizer"``) and ``schedule`` as the learning rate's
    factor per step."""
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = ds_kfac.initialize(
        model=model,
        model_parameters=groups,
        optimizer=ds_kfac.optimizers.client.pop_client_optimizer(config, groups, seed),
        lr_scheduler=lambda optimizer: LambdaLR(optimizer, schedule),
        config=config,
    )
    return engine


@contextlib.contextmanager
def refused_input() -> Iterator[None]:
    """Bad data or config found before step 1 on any rank: one line naming it (rank 0), exit 2 on every rank.
    Every rank ends the block with one agreement (:func:`faults.agree`), so one rank's refusal is every rank's."""
    error = None
    try:
        yield
    except (recipe.ConfigError, shards.ShardError, ValueError, ImportError, faults.DataFault) as caught:
        error = str(caught)
    try:
        faults.agree(error)
    except faults.DataFault as refused:
        if dist.get_rank() == 0:
            print(f"pretrain.py: error: {refused}", file=sys.stderr, flush=True)
        ds_kfac.shutdown()
        sys.exit(2)


@torch.no_grad()
def evaluate(engine: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """Held-out masked-LM loss and accuracy over the masked tokens (every rank, same batches)."""
    engine.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in batches:
        out = engine(**{k: v.to(engine.device) for k, v in batch.items() if k != "next_sentence_label"})
        labels = batch["labels"].to(engine.device)
        chosen = labels != masking.IGNORE_INDEX
        logits = out.prediction_logits.float()[chosen]
        loss_sum += torch.nn.functional.cross_entropy(logits, labels[chosen], reduction="sum").item()
        correct += (logits.argmax(-1) == labels[chosen]).sum().item()
        count += chosen.sum().item()
    engine.train()
    return loss_sum / max(1, count), correct / max(1, count)


# --------------------------------------------------------------------------- training


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    ds_kfac.init_distributed()  # deepspeed.init_distributed, refusing a stale build lock instead of hanging
    # Each rank on its own device before the data's collectives (NCCL's run on the current device; the engine sets
    # it later, too late for them). A no-op on the CPU.
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = dist.get_rank(), dist.get_world_size()
    with refused_input():
        config, bert = recipe.read_config(args.deepspeed_config)
        for key in ("max_steps", "eval_every", "vocab_size"):
            if getattr(args, key) is not None:
                bert[key] = getattr(args, key)
        found = run_data.open_data(args, bert, args.cache_dir or args.output_dir)
    run_name = args.run_name or Path(args.deepspeed_config).stem
    run_dir = args.output_dir / run_name
    run_dir.mkdir(parents=True, exist_ok=True)

    seq = bert["max_seq_length"]
    model_config = json.loads(
        (ROOT / bert["model"] if not Path(bert["model"]).is_absolute() else Path(bert["model"])).read_text()
    )
    model_config.update(
        vocab_size=found.vocab_size, max_position_embeddings=max(model_config.get("max_position_embeddings", 512), seq)
    )
    torch.manual_seed(args.seed)
    model = BertForPreTraining(BertConfig(**model_config))
    max_steps = bert["max_steps"]
    schedule = poly_warmup(max_steps, bert["warmup_proportion"], bert["poly_power"])
    engine = build_engine(model, config, schedule, args.seed)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accum * world
    with refused_input():
        train_batches, order, held_out = found.batches(micro, accum)

    start_step = 0
    pins = {**found.pins, "seed": args.seed, "global_batch": global_batch}
    if args.resume:
        path, client = engine.load_checkpoint(str(run_dir / "checkpoints"))
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        start_step = client["step"]
        with refused_input():
            run_data.check_pins("--resume", client, pins, tuple(pins), args.new_data)
    elif args.init_checkpoint is not None:
        path, client = engine.load_checkpoint(str(args.init_checkpoint), load_module_only=True)
        if path is None:
            raise FileNotFoundError(f"--init-checkpoint: no checkpoint in {args.init_checkpoint}")
        with refused_input():
            run_data.check_pins("--init-checkpoint", client or {}, pins, ("vocabulary",), args.new_data)

    writer = report.MetricsWriter(run_dir / "metrics.csv", start_step) if rank == 0 else None
    kfac = getattr(engine, "kfac", None)
    if rank == 0:
        (run_dir / "corpus.json").write_text(json.dumps(found.record, indent=1) + "\n")
        if found.tokenizer is not None:  # what a phase 2 from this run's weights must use
            found.tokenizer.save_pretrained(str(run_dir / "tokenizer"))
        origin = found.record.get("shards") or found.record.get("nvidia_hdf5")
        print(
            f"data {origin}: {found.record['train_pairs']} training / {found.record['held_out_pairs']} held-out pairs; "
            f"BERT {model_config['num_hidden_layers']}x{model_config['hidden_size']} vocab {found.vocab_size}, "
            f"seq {seq}; {world} ranks x {micro} x {accum} accumulation = batch {global_batch}; steps "
            f"{start_step}..{max_steps}; K-FAC: {len(kfac.blocks) if kfac else 0} layers",
            flush=True,
        )

    previous_seconds = (
        float(report.read_metrics(run_dir / "metrics.csv")[-1]["seconds"]) if start_step and rank == 0 else 0.0
    )
    batches = found.loader(train_batches, order, start_step, max_steps)
    ranks = report.RankReport(rank)
    train_seconds = 0.0  # optimizer steps only: evaluation and checkpoints are not timed
    bar = tqdm(range(start_step, max_steps), disable=rank != 0, initial=start_step, total=max_steps, dynamic_ncols=True)
    try:
        for step in bar:
            torch.manual_seed(args.seed * 1_000_003 + step * world + rank)  # dropout: a function of the step
            started = time.perf_counter()
            total = 0.0
            micro_batches, fault = faults.fetch_step(batches, accum)  # all of the step's, before its first collective
            waited = time.perf_counter() - started
            faults.agree(fault, engine.device)  # a data fault on any rank stops every rank here
            for batch in micro_batches:
                batch = {k: v.to(engine.device) for k, v in batch.items()}
                out = engine(**batch)
                if kfac is not None:  # with "fisher": "sampled", G from masked-LM targets drawn from the model
                    kfac.sample_fisher(out.prediction_logits, "cross_entropy", labels=batch["labels"])
                loss = out.loss
                engine.backward(loss)
                engine.step()
                total += loss.item() / accum
            lr = engine.get_lr()[0]
            elapsed = time.perf_counter() - started
            train_seconds += elapsed
            seconds = previous_seconds + train_seconds
            last = step + 1 == max_steps
            interrupted = args.stop_after is not None and step + 1 - start_step == args.stop_after and not last
            ranks.step(step + 1, elapsed, waited, last or interrupted)
            row: dict[str, object] = {
                "step": step + 1,
                "samples": (step + 1) * global_batch,
                "seconds": f"{seconds:.3f}",
                "data_seconds": f"{waited:.4f}",
                "loss": f"{total:.6f}",
                "lr": f"{lr:.6g}",
            }
            if held_out and ((bert["eval_every"] and (step + 1) % bert["eval_every"] == 0) or last):
                mlm_loss, mlm_acc = evaluate(engine, held_out)
                row.update(held_out_mlm_loss=f"{mlm_loss:.6f}", held_out_mlm_accuracy=f"{mlm_acc:.6f}")
            if writer is not None:
                writer.write(row)
                bar.set_postfix(
                    loss=f"{total:.3f}",
                    lr=f"{lr:.2e}",
                    samples_per_s=f"{(step + 1 - start_step) * global_batch / train_seconds:.1f}",
                )
            if (bert["save_every"] and (step + 1) % bert["save_every"] == 0) or last or interrupted:
                state = {"step": step + 1, "data": pins}
                engine.save_checkpoint(str(run_dir / "checkpoints"), tag=f"step{step + 1}", client_state=state)
            if interrupted:
                break
    except faults.DataFault as stopped:  # every rank, at the same step
        bar.close()
        del batches
        if rank == 0:
            print(f"pretrain.py: error: {stopped}", file=sys.stderr, flush=True)
        ds_kfac.shutdown()
        sys.exit(1)
    bar.close()
    del batches  # the loader workers end here, before the process group does
    ranks.write(run_dir / "ranks" / f"rank-{rank}.json")

    if rank == 0:
        waited, stepped = ranks.record["data_wait_seconds"], ranks.record["step_seconds"]
        print(f"data: the steps waited {waited:.2f} s of {stepped:.1f} s ({100 * waited / max(stepped, 1e-9):.2f}%)")
        (args.output_dir / "summary.txt").write_text(report.summary_table(args.output_dir) + "\n")
        print(report.summary_table(args.output_dir))
        print(f"plot: {report.plot(args.output_dir)}")
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
