"""Prepare BERT pretraining data once, for every launch after: documents to tokenized sentences to NSP instances,
in shards on disk that ``pretrain.py --shards`` reads pair by pair.

    python examples/bert/prepare.py --text-dir /data/wikibooks --deepspeed_config configs/bert_large_phase1_kfac.json \\
        --tokenizer /data/bert-large-uncased-tokenizer --out /data/shards/phase1 --workers 32
    python examples/bert/prepare.py --hf-dataset /data/wiki-saved --deepspeed_config CONFIG --out SHARDS
    python examples/bert/prepare.py --corpus packages --deepspeed_config configs/bert_cpu_phase1_lamb.json --out SHARDS

The config's ``"bert"`` section gives the sequence length and, where no ``--tokenizer`` is given, the size of the
WordPiece vocabulary trained on a sample of the training documents (``--tokenizer-sample-mb`` of text from pieces
drawn with the seed). The corpus is cut into pieces of about ``--shard-mb`` of text (:mod:`sources`); each piece,
in a worker process of its own (``--workers``), is read, its documents split into training and held-out ones
(``--held-out-fraction`` of them, at least two when it has four or more), their sentences tokenized with the fast
``tokenizers`` backend and cut into NSP instances as BERT's ``create_pretraining_data.py`` does (B drawn from
another document of the same shard), and written as one shard (:mod:`shards`). Memory holds one piece per worker,
whatever the corpus size. The result is deterministic for a seed and the same for any number of workers.

A shard appears only when complete and the manifest is written last: a preparation killed half way leaves no shard
that reads as complete, and running the same command again prepares only the missing shards. A directory that holds
another preparation (other input, settings or tokenizer) is refused, never written over.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import corpora  # noqa: E402
import pairing  # noqa: E402
import recipe  # noqa: E402
import shards  # noqa: E402
import sources  # noqa: E402
import stamps  # noqa: E402
from corpus import Source, embedded_source, hf_dataset_source, shards_source, text_dir_source  # noqa: E402
from out_dir import locked, tokenizer_for  # noqa: E402
from shard_jobs import Job, Settings, in_workers, prepare_shard  # noqa: E402

PIECE_BYTES = 32_000_000
"""Text per shard by default (``--shard-mb``): a worker holds one piece's text, documents and ids at a time."""
VERSIONED = ("numpy", "tokenizers", "transformers")
"""Packages whose versions the manifest records (with Python's)."""
COUNTED = (
    *("text_bytes", "documents", "held_out_documents", "sentences", "tokens", "train_pairs", "held_out_pairs"),
    *("random_next_pairs", "pair_tokens"),
)
"""What each shard counts and the manifest totals."""

if TYPE_CHECKING:  # imported where used: a worker process reads, tokenizes and writes without it
    from transformers import PreTrainedTokenizerFast


# --------------------------------------------------------------------------- the whole preparation


def prepare(
    source: Source,
    out: Path,
    settings: Settings,
    vocab_size: int,
    tokenizer: Optional[PreTrainedTokenizerFast] = None,
    workers: int = 1,
    sample_bytes: int = 128 << 20,
    progress: bool = True,
) -> dict[str, Any]:
    """Prepare ``source`` into ``out`` (or find it prepared there: read only), holding its lock; the manifest. See
    the module docstring."""
    if (out / shards.MANIFEST).is_file():
        return _prepared(out, source, settings, tokenizer)
    with locked(out):
        return _prepare(source, out, settings, vocab_size, tokenizer, workers, sample_bytes, progress)


def _prepare(
    source: Source,
    out: Path,
    settings: Settings,
    vocab_size: int,
    tokenizer: Optional[PreTrainedTokenizerFast],
    workers: int,
    sample_bytes: int,
    progress: bool,
) -> dict[str, Any]:
    if (out / shards.MANIFEST).is_file():  # another preparation finished it while this one waited for nothing
        return _prepared(out, source, settings, tokenizer)
    started = time.perf_counter()
    for stale in out.glob(".*.tmp"):  # a killed run's unfinished shard or tokenizer
        shutil.rmtree(stale, ignore_errors=True)
    tokenizer = tokenizer_for(out, source, settings, tokenizer, vocab_size, sample_bytes)
    digest = shards.tokenizer_digest(tokenizer)
    jobs, records = [], {}
    for piece in source.pieces:
        identity = {
            "source": source.key,
            "piece": piece.reader.describe(source.root),
            "settings": asdict(settings),
            "tokenizer": digest,
        }
        directory = out / shards.shard_name(piece.index)
        if directory.is_dir():
            record = shards.read_json(directory / shards.SHARD_RECORD, "shard record")
            if any(record.get(key) != value for key, value in identity.items()):
                raise shards.ShardError(
                    f"{directory}: prepared from other input or settings than this command's: prepare into another "
                    f"--out, or remove {out}"
                )
            records[piece.index] = record
        else:
            tokens_from = piece.reader.path if isinstance(piece.reader, sources.PreparedShard) else None
            jobs.append(Job(piece, str(out), str(out / shards.TOKENIZER / "tokenizer.json"), identity, tokens_from))
    total = sum(piece.text_bytes for piece in source.pieces)
    done = total - sum(job.piece.text_bytes for job in jobs)
    bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="prepare", disable=not progress)
    if workers > 1 and len(jobs) > 1:

        def done(record: dict[str, Any]) -> None:
            records[int(record["shard"].removeprefix("shard-"))] = record
            bar.update(record["text_bytes"])

        in_workers(jobs, min(workers, len(jobs)), done)
    else:
        for job in jobs:
            records[job.piece.index] = prepare_shard(job)
            bar.update(job.piece.text_bytes)
    bar.close()
    manifest = _manifest(source, settings, tokenizer, [records[i] for i in range(len(source.pieces))])
    shards.write_json(out / shards.MANIFEST, manifest)
    written = [shards.shard_name(job.piece.index) for job in jobs]  # their digests were computed from disk just now
    arrays = {name: [out / name / file for file in shards.ARRAYS] for name in written}
    stamps.Stamp(out, manifest["digest"]).write(stamps.identities(arrays))
    seconds = time.perf_counter() - started
    totals = manifest["totals"]
    print(
        f"prepared {len(source.pieces)} shards ({len(jobs)} new) in {out}: {totals['text_bytes'] / 1e6:.1f} MB of "
        f"text, {totals['documents']} documents, {totals['tokens']} tokens, {totals['train_pairs']} training / "
        f"{totals['held_out_pairs']} held-out pairs ({describe_pairs(totals, settings.max_seq_length)}); "
        f"{seconds:.1f} s"
    )
    return manifest


def describe_pairs(totals: dict[str, int], max_seq_length: int) -> str:
    """The training pairs' share with a random B and their mean fill of a sequence, in words."""
    pairs = max(1, totals["train_pairs"])
    fill = totals["pair_tokens"] / pairs / max_seq_length
    return f"{totals['random_next_pairs'] / pairs:.1%} with a random B, sequences {fill:.1%} full on average"


def _prepared(out: Path, source: Source, settings: Settings, tokenizer: Optional[Any]) -> dict[str, Any]:
    """The manifest of ``out`` if it is this preparation's, else a refusal (nothing is written over)."""
    manifest = shards.read_json(out / shards.MANIFEST, "manifest")
    wanted = {"source": source.record, "settings": asdict(settings)}
    differ = [key for key, value in wanted.items() if manifest.get(key) != value]
    if tokenizer is not None and manifest.get("tokenizer", {}).get("digest") != shards.tokenizer_digest(tokenizer):
        differ.append("tokenizer")
    if differ:
        raise shards.ShardError(
            f"{out} holds another preparation (its {', '.join(differ)} differ from this command's): prepare into "
            f"another --out, or remove it"
        )
    print(f"already prepared: {out}")
    return manifest


def _manifest(
    source: Source, settings: Settings, tokenizer: PreTrainedTokenizerFast, records: list[dict[str, Any]]
) -> dict[str, Any]:
    manifest = {
        "format": shards.FORMAT,
        "source": source.record,
        "settings": asdict(settings),
        "max_seq_length": settings.max_seq_length,
        "tokenizer": {
            "path": shards.TOKENIZER,
            "digest": shards.tokenizer_digest(tokenizer),
            "vocab_size": len(tokenizer),
            "token_dtype": pairing.token_dtype(len(tokenizer)).name,
        },
        "versions": {"python": platform.python_version(), **{p: importlib.metadata.version(p) for p in VERSIONED}},
        "text_digest": hashlib.sha256("".join(r["text_digest"] for r in records).encode()).hexdigest(),
        "totals": {key: sum(r[key] for r in records) for key in COUNTED},
        "shards": [
            {"name": shards.shard_name(i), **{key: r[key] for key in (*COUNTED, "files", "digest")}}
            for i, r in enumerate(records)
        ],
    }
    return {**manifest, "digest": shards.manifest_digest(manifest)}


# --------------------------------------------------------------------------- command line


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    inputs = parser.add_mutually_exclusive_group(required=True)
    inputs.add_argument("--text-dir", type=Path, help="a directory of text files laid out as --layout says")
    inputs.add_argument("--hf-dataset", type=Path, help="a datasets dataset saved with save_to_disk (a row a document)")
    inputs.add_argument("--corpus", choices=corpora.EMBEDDED_CORPORA, help="an embedded corpus (no download)")
    inputs.add_argument(
        "--from-shards",
        type=Path,
        help="shards prepared before (phase 1's), paired again at this config's sequence length from their tokens, "
        "with their tokenizer, held-out split and seed (no text read, nothing tokenized)",
    )
    parser.add_argument(
        "--layout",
        choices=sources.LAYOUTS,
        default="blank-lines",
        help="--text-dir's documents: *.txt, blocks of lines ended by a blank line (default); *.txt, one per line; "
        "*.jsonl, one JSON object per line (its --text-column field)",
    )
    parser.add_argument("--text-column", default="text", help="the dataset's text column, or a JSON line's field")
    parser.add_argument("--group-rows", type=int, default=1, help="--hf-dataset: this many rows a document")
    parser.add_argument(
        "--document-column", help="--hf-dataset: consecutive rows sharing this column's value are a document"
    )
    parser.add_argument("--tokenizer", type=Path, help="a saved fast tokenizer (save_pretrained); default: train one")
    parser.add_argument(
        "--deepspeed_config", type=Path, required=True, help="its 'bert' section: sequence length, vocabulary size"
    )
    parser.add_argument("--out", type=Path, required=True, help="the directory of shards to write")
    parser.add_argument("--workers", type=int, default=1, help="processes preparing shards in parallel")
    parser.add_argument("--seed", type=int, default=0, help="held-out split, tokenizer sample and sentence pairs")
    parser.add_argument("--held-out-fraction", type=float, default=0.05)
    parser.add_argument("--short-seq-prob", type=float, default=0.1)
    parser.add_argument(
        "--dupe-factor", type=int, default=1, help="pairings of each shard's training documents (NVIDIA's files: 5)"
    )
    parser.add_argument("--shard-mb", type=float, default=PIECE_BYTES / 1e6, help="text per shard, in MB")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=128.0, help="text the vocabulary is trained on")
    parser.add_argument("--cache-dir", type=Path, help="the embedded corpus's cache (--corpus packages)")
    args = parser.parse_args(argv)
    if args.group_rows != 1 and args.document_column is not None:
        parser.error("give --group-rows or --document-column, not both")
    for name in ("workers", "shard_mb", "tokenizer_sample_mb", "group_rows", "dupe_factor"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def source_of(args: argparse.Namespace, piece_bytes: int) -> Source:
    if args.text_dir is not None:
        return text_dir_source(args.text_dir, piece_bytes, args.layout, args.text_column)
    if args.hf_dataset is not None:
        return hf_dataset_source(args.hf_dataset, args.text_column, piece_bytes, args.group_rows, args.document_column)
    return embedded_source(args.corpus, args.cache_dir, piece_bytes)


def main(argv: Optional[list[str]] = None) -> None:
    from transformers import PreTrainedTokenizerFast

    args = parse_args(argv)
    try:
        _, bert = recipe.read_config(args.deepspeed_config)
        seed, held_out_fraction = args.seed, args.held_out_fraction
        if args.from_shards is not None:  # their tokens, split and seed: only the pairing is new
            source, manifest = shards_source(args.from_shards)
            seed, held_out_fraction = manifest["settings"]["seed"], manifest["settings"]["held_out_fraction"]
            args.tokenizer = args.tokenizer or args.from_shards / shards.TOKENIZER
        else:
            source = source_of(args, int(args.shard_mb * 1e6))
        settings = Settings(bert["max_seq_length"], args.short_seq_prob, held_out_fraction, seed, args.dupe_factor)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.tokenizer)) if args.tokenizer else None
        if tokenizer is not None and len(tokenizer) != bert["vocab_size"]:
            raise recipe.ConfigError(
                f"{args.tokenizer}: a {len(tokenizer)}-token vocabulary, {args.deepspeed_config}'s bert.vocab_size is "
                f"{bert['vocab_size']}"
            )
        sample = int(args.tokenizer_sample_mb * 1e6)
        prepare(source, args.out, settings, bert["vocab_size"], tokenizer, args.workers, sample)
    except (ValueError, OSError) as error:  # bad input: one line naming it (ShardError and ConfigError included)
        sys.exit(f"prepare.py: error: {error}")


if __name__ == "__main__":
    main()
