"""A small GPT trained with tensor, pipeline and data parallelism, and K-FAC: ``deepspeed.initialize`` swapped for
``ds_kfac.initialize``.

The transformer blocks are built from megatron-core's tensor-parallel layers (column-parallel QKV and MLP-in,
row-parallel attention-out and MLP-out), the model is a DeepSpeed ``PipelineModule``, and the ranks left over form
the data-parallel dimension: ``world = tp * pp * dp``. Launch as any DeepSpeed pipeline script::

    deepspeed --num_gpus 4 examples/gpt/train.py --tp 2 --pp 2 --deepspeed_config configs/gpt_kfac_cpu.json
    deepspeed --hostfile hosts --num_nodes 4 --num_gpus 8 examples/gpt/train.py --tp 8 --pp 4 \\
        --layers 24 --hidden 2048 --heads 16 --deepspeed_config configs/gpt_kfac_cpu.json

On CPU the ranks talk over gloo (DeepSpeed's CPU accelerator); on GPUs over NCCL. Megatron's
``parallel_state`` and DeepSpeed's pipeline topology use the same rank order (tensor-parallel rank fastest, then
data-parallel, then pipeline stage), so each pipeline stage's tensor-parallel group is Megatron's.

Data: ``--text-dir`` reads a directory of text files; without it the embedded default is the docstrings of
Python's standard library (the BERT example's corpus and WordPiece tokenizer), so the script runs anywhere with no
download. Documents are split into training and held-out sets; the token stream of each is cut into windows of
``--seq + 1`` tokens (next-token prediction). Every run writes ``<output-dir>/<run-name>/metrics.csv`` (per step:
training seconds, loss, learning rate; held-out loss every ``--eval-every`` steps, written by the last stage's
first rank).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from torch import nn

sys.path.insert(0, str(Path(__file__).parent.parent / "bert"))
import corpora  # noqa: E402  (the BERT example's corpus, tokenizer and pairs)
import pairing  # noqa: E402
import sources  # noqa: E402
import wordpiece  # noqa: E402

import ds_kfac  # noqa: E402


class Embedding(nn.Module):
    """Token and position embeddings (replicated on every tensor-parallel rank)."""

    def __init__(self, vocab: int, hidden: int, seq: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq, hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """A pre-norm transformer block whose four linear maps are sharded over the tensor-parallel group:
    QKV and MLP-in column-parallel (each rank its heads, its slice of the MLP), attention-out and MLP-out
    row-parallel (summed over the group)."""

    def __init__(self, hidden: int, heads: int, config: ModelParallelConfig, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        tp = config.tensor_model_parallel_size
        if heads % tp or hidden % heads:
            raise ValueError(f"--heads {heads} must divide --hidden {hidden} and be a multiple of --tp {tp}")
        self.heads, self.head_dim = heads // tp, hidden // heads
        init = nn.init.xavier_normal_
        column = dict(config=config, init_method=init, bias=True, gather_output=False)
        row = dict(config=config, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False)
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, **column)
        self.proj = RowParallelLinear(hidden, hidden, **row)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp_in = ColumnParallelLinear(hidden, 4 * hidden, **column)
        self.mlp_out = RowParallelLinear(4 * hidden, hidden, **row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv, _ = self.qkv(self.norm1(x))
        q, k, v = qkv.view(b, s, self.heads, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out, _ = self.proj(attn.transpose(1, 2).reshape(b, s, -1))
        x = x + out
        h, _ = self.mlp_in(self.norm2(x))
        out, _ = self.mlp_out(F.gelu(h))
        return x + out


class Head(nn.Module):
    """Final norm and the vocabulary projection (replicated on every tensor-parallel rank)."""

    def __init__(self, hidden: int, vocab: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(args: argparse.Namespace, vocab: int, topology: PipeModelDataParallelTopology) -> PipelineModule:
    """The GPT as a pipeline of layer specs. Each layer seeds its own initialisation (``--seed`` and its
    index), so the weights do not depend on how the layers are split into stages, and each tensor-parallel rank
    keeps its shard of the same weights (megatron-core's CPU initialisation splits a master weight)."""
    config = ModelParallelConfig(tensor_model_parallel_size=args.tp, use_cpu_initialization=True)
    seed = 1000 * args.seed
    layers = [LayerSpec(Embedding, vocab, args.hidden, args.seq, seed)]
    layers += [LayerSpec(Block, args.hidden, args.heads, config, seed + 1 + i) for i in range(args.layers)]
    layers += [LayerSpec(Head, args.hidden, vocab, seed + 1 + args.layers)]
    return PipelineModule(layers, topology=topology, loss_fn=next_token_loss, partition_method="type:Block")


def token_windows(documents: list[pairing.Document], tokenizer, seq: int) -> torch.Tensor:
    """The documents' token stream cut into non-overlapping windows of ``seq + 1`` tokens."""
    ids = [token for doc in documents for token in tokenizer(" ".join(doc), add_special_tokens=False)["input_ids"]]
    n = len(ids) // (seq + 1)
    return torch.tensor(ids[: n * (seq + 1)], dtype=torch.long).view(n, seq + 1)


def batches(windows: torch.Tensor, micro_batch: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, labels) micro-batches in an order fixed by ``seed`` (the same on every rank of a replica)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(windows), generator=generator)
        for start in range(0, len(order) - micro_batch + 1, micro_batch):
            w = windows[order[start : start + micro_batch]]
            yield w[:, :-1], w[:, 1:]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1024, help="WordPiece vocabulary size of the embedded default")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text-dir", type=str, default=None, help="a directory of .txt files (default: embedded)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/gpt"))
    parser.add_argument("--run-name", type=str, default=None, help="default: the config's file name")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = ds_kfac.add_config_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # one thread per rank: on CPU the ranks share the cores
    torch.manual_seed(args.seed)
    ds_kfac.init_distributed()  # deepspeed.init_distributed, refusing a stale build lock instead of hanging
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise ValueError(f"world size {world} is not a multiple of --tp {args.tp} x --pp {args.pp}")
    dp = world // (args.tp * args.pp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    topology = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=dp)

    documents = sources.read_text_dir(args.text_dir) if args.text_dir else corpora.embedded_corpus()
    train_docs, held_out_docs = pairing.split_documents(documents, held_out_fraction=0.05, seed=0)
    tokenizer = wordpiece.train_tokenizer(train_docs, vocab_size=args.vocab, cache_dir=args.output_dir / "cache")
    train, held_out = (token_windows(d, tokenizer, args.seq) for d in (train_docs, held_out_docs))

    model = build_model(args, len(tokenizer), topology)
    engine, _, _, _ = ds_kfac.initialize(args=args, model=model, model_parameters=model.parameters())
    replica = topology.get_coord(dist.get_rank()).data
    train_iter = batches(train, engine.train_micro_batch_size_per_gpu(), args.seed * 1000 + replica)

    run_dir = args.output_dir / (args.run_name or Path(args.deepspeed_config).stem)
    writes = engine.is_last_stage() and topology.get_coord(dist.get_rank()).model == 0 and replica == 0
    rows, seconds = [], 0.0
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        loss = engine.train_batch(data_iter=train_iter)
        seconds += time.perf_counter() - start
        row = {"step": step, "seconds": round(seconds, 3), "loss": float(loss), "lr": engine.get_lr()[0]}
        if step % args.eval_every == 0 or step == args.steps:
            row["held_out_loss"] = evaluate(engine, held_out)
        rows.append(row)
        if writes and "held_out_loss" in row:
            print(f"step {step}: loss {row['loss']:.4f}, held-out loss {row['held_out_loss']:.4f}", flush=True)
    if writes:
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "metrics.csv", "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=["step", "seconds", "loss", "lr", "held_out_loss"])
            out.writeheader()
            out.writerows(rows)
        (run_dir / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=1))
    ds_kfac.shutdown()


def evaluate(engine: deepspeed.PipelineEngine, windows: torch.Tensor) -> float:
    """Mean next-token loss over the held-out windows (whole micro-batches), on every rank."""
    micro = engine.train_micro_batch_size_per_gpu()
    n = (len(windows) // micro) // engine.micro_batches * engine.micro_batches
    if n == 0:
        raise ValueError(f"{len(windows)} held-out windows make no batch of {engine.micro_batches} micro-batches")
    pairs = [(w[:, :-1], w[:, 1:]) for w in windows[: n * micro].split(micro)]
    losses = []
    for start in range(0, n, engine.micro_batches):
        it = iter(pairs[start : start + engine.micro_batches])
        losses.append(float(engine.eval_batch(data_iter=it)))
    return sum(losses) / len(losses) if losses else math.nan


if __name__ == "__main__":
    main()
