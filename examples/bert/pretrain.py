"""BERT pretraining (masked LM + next-sentence prediction) with DeepSpeed, LAMB and K-FAC.

Launch as any DeepSpeed script; the config file says everything about the phase::

    deepspeed --num_gpus 2 examples/bert/pretrain.py --deepspeed_config configs/bert_cpu_phase1_lamb.json
    deepspeed --num_gpus 2 examples/bert/pretrain.py --deepspeed_config configs/bert_cpu_phase2_kfac.json \\
        --init-checkpoint runs/bert/bert_cpu_phase1_lamb
    deepspeed --hostfile hosts examples/bert/pretrain.py --deepspeed_config configs/bert_large_phase1_kfac.json \\
        --text-dir /data/wikibooks --tokenizer /data/bert-large-uncased-tokenizer --output-dir runs/phase1
    deepspeed --hostfile hosts examples/bert/pretrain.py --deepspeed_config configs/bert_large_phase2_kfac.json \\
        --text-dir /data/wikibooks --tokenizer /data/bert-large-uncased-tokenizer --output-dir runs/phase2 \\
        --init-checkpoint runs/phase1/bert_large_phase1_kfac/checkpoints

Besides DeepSpeed's keys, the config has a ``"bert"`` section (read here, not
passed to DeepSpeed): ``model`` (a ``transformers.BertConfig`` JSON),
``max_seq_length``, ``max_steps``, ``warmup_proportion``, ``poly_power``,
``eval_every``, ``save_every``, ``vocab_size`` (of the tokenizer trained
when none is given). The learning rate follows NVIDIA's recipe:
linear warm-up, then ``(1 - progress) ** poly_power`` decay. A
``"client_optimizer"`` section (``{"class": "pytorch_optimizer.SOAP", "params":
{...}}``) replaces the ``"optimizer"`` section with any ``torch.optim.Optimizer``
(:func:`ds_kfac.optimizers.client.pop_client_optimizer`; both sections are refused), passed to
``ds_kfac.initialize``.

Data: ``--text-dir`` (plain-text files), ``--hf-dataset`` (a ``datasets``
dataset saved with ``save_to_disk``), or by default an embedded corpus, so the
script runs offline: ``--corpus packages`` (the default) reads the docstrings
of the standard library's and the installed dependencies' Python sources
(torch, transformers, deepspeed, numpy, scipy, scikit-learn, ...; about 34k
documents, 18 MB of text and 120k training pairs at sequence length 64 and a
1024-token vocabulary), parsed without importing them and cached in
``<cache-dir>/corpus-cache`` (``--cache-dir``, default the output directory); ``--corpus stdlib`` is the earlier, smaller
corpus of imported standard-library docstrings (2.3k documents, 5.4k such
pairs). A WordPiece vocabulary is trained on the training documents (cached in
``<cache-dir>/tokenizer-cache``), and the sentences' token ids are cached in
``<cache-dir>/encoding-cache``. Documents are split into training and
held-out sets; the held-out set is never trained on. The corpus digest and the
versions of what it was built from are printed and recorded.

Each run writes ``<output-dir>/<run-name>/``: ``metrics.csv`` (every step),
``corpus.json`` (the corpus's source, package versions, digest, document and
pair counts), ``tokenizer/`` (the tokenizer it used), ``checkpoints/`` (DeepSpeed checkpoints with K-FAC state), and
refreshes ``<output-dir>/summary.txt`` and ``<output-dir>/loss.png`` with every
run found there. ``--resume`` continues an interrupted run exactly (data
order, masks and dropout are functions of the step); ``--init-checkpoint``
starts phase 2 from phase 1's weights with a fresh optimizer and fresh K-FAC
state (given a run directory, from its ``checkpoints/`` and with its ``tokenizer/``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR
from tqdm import tqdm
from transformers import BertConfig, BertForPreTraining, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).parent))
import data  # noqa: E402
import report  # noqa: E402

import ds_kfac  # noqa: E402

T = TypeVar("T")

BERT_DEFAULTS = {
    "model": "configs/bert/bert-tiny.json",
    "max_seq_length": 128,
    "max_steps": 100,
    "warmup_proportion": 0.1,
    "poly_power": 0.5,
    "eval_every": 25,
    "save_every": 0,
    "vocab_size": 8192,
}
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--text-dir", type=Path, help="directory of plain-text files (default: embedded corpus)")
    parser.add_argument("--hf-dataset", type=Path, help="a datasets dataset saved with save_to_disk")
    parser.add_argument("--text-column", default="text")
    parser.add_argument(
        "--corpus",
        choices=data.EMBEDDED_CORPORA,
        default="packages",
        help="the embedded corpus, used without --text-dir or --hf-dataset: 'packages' (docstrings of the standard "
        "library's and the dependencies' sources) or 'stdlib' (the small one of imported standard-library modules)",
    )
    parser.add_argument("--tokenizer", type=Path, help="a saved tokenizer (save_pretrained); default: train one")
    parser.add_argument("--vocab-size", type=int, help="override bert.vocab_size (when training a tokenizer)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bert"))
    parser.add_argument(
        "--cache-dir", type=Path, help="the corpus, tokenizer and encoding caches (default: the output directory)"
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
        "--stop-after", type=int, help="save a checkpoint and exit after this many steps (a job's time limit)"
    )
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out micro-batches per evaluation")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0, help="initialisation, data order, masks and dropout")
    parser.add_argument(
        "--data-seed", type=int, default=0, help="held-out split, tokenizer and held-out masks (fixed across --seed)"
    )
    parser.add_argument("--local_rank", type=int, default=-1)
    ds_kfac.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required")
    if args.init_checkpoint is not None and (args.init_checkpoint / "checkpoints").is_dir():
        run_dir = args.init_checkpoint
        args.init_checkpoint = run_dir / "checkpoints"
        if args.tokenizer is None and (run_dir / "tokenizer").is_dir():
            args.tokenizer = run_dir / "tokenizer"
    return args


def poly_warmup(max_steps: int, warmup_proportion: float, power: float):
    """NVIDIA's BERT schedule: linear warm-up, then polynomial decay to 0 at ``max_steps``."""
    warmup = max(1, int(warmup_proportion * max_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, 1.0 - (step - warmup) / max(1, max_steps - warmup)) ** power

    return factor


def rank_zero_first(build: Callable[[], T]) -> T:
    """``build()`` on rank 0, then, after a barrier, on the other ranks: rank 0 fills a cache the others read."""
    if dist.get_rank() == 0:
        result = build()
    dist.barrier()
    if dist.get_rank() != 0:
        result = build()
    return result


def load_documents(args: argparse.Namespace, cache: Path) -> tuple[list[data.Document], dict[str, Any]]:
    """The corpus and a record of it: source, versions, digest (rank 0 builds and caches the embedded one first)."""
    if args.text_dir is not None or args.hf_dataset is not None:
        documents = data.load_corpus(args.text_dir, args.hf_dataset, args.text_column)
        source = {"text_dir": str(args.text_dir)} if args.text_dir is not None else {"hf_dataset": str(args.hf_dataset)}
    else:
        documents = rank_zero_first(lambda: data.embedded_corpus(args.corpus, cache_dir=cache))
        source = {"embedded": args.corpus, "versions": data.corpus_sources(args.corpus)}
    return documents, {
        **source,
        "digest": data.corpus_digest(documents),
        "documents": len(documents),
        "sentences": sum(map(len, documents)),
    }


def load_tokenizer(
    args: argparse.Namespace, train_docs: list[data.Document], vocab_size: int, cache: Path
) -> PreTrainedTokenizerFast:
    """The given tokenizer, or one trained on the training documents (rank 0 trains and caches; others load)."""
    if args.tokenizer is not None:
        return PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer))
    return rank_zero_first(lambda: data.train_tokenizer(train_docs, vocab_size, cache_dir=cache))


def load_examples(
    docs: list[data.Document], tokenizer: PreTrainedTokenizerFast, seq: int, seed: int, cache: Path
) -> list[data.PretrainingExample]:
    """The documents' NSP pairs (rank 0 encodes and caches their sentences first; the others load them)."""
    encoded = rank_zero_first(lambda: data.encode_sentences(docs, tokenizer, cache_dir=cache))
    return data.pair_examples(docs, encoded, tokenizer, seq, seed=seed)


@torch.no_grad()
def evaluate(engine: Any, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """Held-out masked-LM loss and accuracy over the masked tokens (every rank, same batches)."""
    engine.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for batch in batches:
        out = engine(**{k: v.to(engine.device) for k, v in batch.items() if k != "next_sentence_label"})
        labels = batch["labels"].to(engine.device)
        chosen = labels != data.IGNORE_INDEX
        logits = out.prediction_logits.float()[chosen]
        loss_sum += torch.nn.functional.cross_entropy(logits, labels[chosen], reduction="sum").item()
        correct += (logits.argmax(-1) == labels[chosen]).sum().item()
        count += chosen.sum().item()
    engine.train()
    return loss_sum / max(1, count), correct / max(1, count)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    ds_kfac.init_distributed()  # deepspeed.init_distributed, refusing a stale build lock instead of hanging
    rank, world = dist.get_rank(), dist.get_world_size()

    config = json.loads(Path(args.deepspeed_config).read_text())
    bert = {**BERT_DEFAULTS, **config.pop("bert", {})}
    if args.max_steps is not None:
        bert["max_steps"] = args.max_steps
    if args.eval_every is not None:
        bert["eval_every"] = args.eval_every
    if args.vocab_size is not None:
        bert["vocab_size"] = args.vocab_size
    run_name = args.run_name or Path(args.deepspeed_config).stem
    run_dir = args.output_dir / run_name
    run_dir.mkdir(parents=True, exist_ok=True)

    cache = args.cache_dir or args.output_dir
    documents, corpus = load_documents(args, cache / "corpus-cache")
    train_docs, held_docs = data.split_documents(documents, args.held_out_fraction, seed=args.data_seed)
    tokenizer = load_tokenizer(args, train_docs, bert["vocab_size"], cache / "tokenizer-cache")
    seq, encoding_cache = bert["max_seq_length"], cache / "encoding-cache"
    train_set = data.PretrainingDataset(
        load_examples(train_docs, tokenizer, seq, args.seed, encoding_cache), tokenizer, seed=args.seed
    )
    held_set = data.PretrainingDataset(
        load_examples(held_docs, tokenizer, seq, args.data_seed + 1, encoding_cache),
        tokenizer,
        seed=args.data_seed + 1,
    )

    model_config = json.loads(
        (ROOT / bert["model"] if not Path(bert["model"]).is_absolute() else Path(bert["model"])).read_text()
    )
    model_config.update(
        vocab_size=len(tokenizer), max_position_embeddings=max(model_config.get("max_position_embeddings", 512), seq)
    )
    torch.manual_seed(args.seed)
    model = BertForPreTraining(BertConfig(**model_config))
    max_steps = bert["max_steps"]
    schedule = poly_warmup(max_steps, bert["warmup_proportion"], bert["poly_power"])
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    groups = [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = ds_kfac.initialize(
        model=model,
        model_parameters=groups,
        optimizer=ds_kfac.optimizers.client.pop_client_optimizer(config, groups, args.seed),
        lr_scheduler=lambda optimizer: LambdaLR(optimizer, schedule),
        config=config,
    )
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accum * world

    start_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(str(run_dir / "checkpoints"))
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        start_step = client["step"]
    elif args.init_checkpoint is not None:
        path, _ = engine.load_checkpoint(str(args.init_checkpoint), load_module_only=True)
        if path is None:
            raise FileNotFoundError(f"--init-checkpoint: no checkpoint in {args.init_checkpoint}")

    pad = tokenizer.pad_token_id
    held_batches = [
        data.collate([held_set[i] for i in range(j, min(j + micro, len(held_set)))], pad)
        for j in range(0, min(len(held_set), args.eval_batches * micro), micro)
    ]
    writer = report.MetricsWriter(run_dir / "metrics.csv", start_step) if rank == 0 else None
    kfac = getattr(engine, "kfac", None)
    if rank == 0:
        corpus.update(
            train_documents=len(train_docs),
            held_out_documents=len(held_docs),
            train_pairs=len(train_set),
            held_out_pairs=len(held_set),
            max_seq_length=seq,
            vocab_size=len(tokenizer),
        )
        (run_dir / "corpus.json").write_text(json.dumps(corpus, indent=1) + "\n")
        tokenizer.save_pretrained(str(run_dir / "tokenizer"))  # what a phase 2 from this run's weights must use
        versions = ", ".join(f"{name} {version}" for name, version in corpus.get("versions", {}).items())
        origin = corpus.get("text_dir") or corpus.get("hf_dataset") or f"embedded {corpus['embedded']!r} ({versions})"
        print(f"corpus {corpus['digest']}: {len(documents)} documents from {origin}", flush=True)
        print(
            f"BERT {model_config['num_hidden_layers']}x{model_config['hidden_size']} vocab {len(tokenizer)}, seq {seq}: "
            f"{len(train_set)} training / {len(held_set)} held-out pairs; {world} ranks x {micro} x {accum} accumulation "
            f"= batch {global_batch}; steps {start_step}..{max_steps}; K-FAC: {len(kfac.blocks) if kfac else 0} layers",
            flush=True,
        )

    steps_per_epoch = len(train_set) // global_batch
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_set)} training pairs cannot fill one global batch of {global_batch}")
    previous_seconds = (
        float(report.read_metrics(run_dir / "metrics.csv")[-1]["seconds"]) if start_step and rank == 0 else 0.0
    )
    train_seconds = 0.0  # optimizer steps only: evaluation and checkpoints are not timed
    bar = tqdm(range(start_step, max_steps), disable=rank != 0, initial=start_step, total=max_steps, dynamic_ncols=True)
    for step in bar:
        epoch, position = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed * 7919 + epoch))
        train_set.set_epoch(epoch)
        rows = order[position * global_batch : (position + 1) * global_batch].view(accum, world, micro)[:, rank]
        torch.manual_seed(args.seed * 1_000_003 + step * world + rank)  # dropout: a function of the step
        started = time.perf_counter()
        total = 0.0
        for m in range(accum):
            batch = data.collate([train_set[int(i)] for i in rows[m]], pad)
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            out = engine(**batch)
            if kfac is not None:  # with "fisher": "sampled", G from masked-LM targets drawn from the model
                kfac.sample_fisher(out.prediction_logits, "cross_entropy", labels=batch["labels"])
            loss = out.loss
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        lr = engine.get_lr()[0]
        train_seconds += time.perf_counter() - started
        seconds = previous_seconds + train_seconds
        row: dict[str, object] = {
            "step": step + 1,
            "samples": (step + 1) * global_batch,
            "seconds": f"{seconds:.3f}",
            "loss": f"{total:.6f}",
            "lr": f"{lr:.6g}",
        }
        last = step + 1 == max_steps
        interrupted = args.stop_after is not None and step + 1 - start_step == args.stop_after and not last
        if (bert["eval_every"] and (step + 1) % bert["eval_every"] == 0) or last:
            mlm_loss, mlm_acc = evaluate(engine, held_batches)
            row.update(held_out_mlm_loss=f"{mlm_loss:.6f}", held_out_mlm_accuracy=f"{mlm_acc:.6f}")
        if writer is not None:
            writer.write(row)
            bar.set_postfix(
                loss=f"{total:.3f}",
                lr=f"{lr:.2e}",
                samples_per_s=f"{(step + 1 - start_step) * global_batch / train_seconds:.1f}",
            )
        if (bert["save_every"] and (step + 1) % bert["save_every"] == 0) or last or interrupted:
            engine.save_checkpoint(str(run_dir / "checkpoints"), tag=f"step{step + 1}", client_state={"step": step + 1})
        if interrupted:
            break
    bar.close()

    if rank == 0:
        (args.output_dir / "summary.txt").write_text(report.summary_table(args.output_dir) + "\n")
        print(report.summary_table(args.output_dir))
        print(f"plot: {report.plot(args.output_dir)}")
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
