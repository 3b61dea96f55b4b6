"""The models the command line plans for: Hugging Face BERT (``BertForPreTraining``), built on the meta device.

A spec is a preset name (:data:`PRESETS`) or a ``transformers.BertConfig`` JSON file (``configs/bert/*.json``).
The model and its optimizer's param groups are built as ``examples/bert/pretrain.py`` builds them: the vocabulary
from ``--vocab-size`` or the DeepSpeed config's ``"bert"`` section, the position embeddings at least
``max_seq_length`` long, and two groups (weight decay, and none for biases and LayerNorm). The groups matter under
ZeRO 1/2: they decide where the partitions cut the parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

PRESETS: dict[str, dict[str, Any]] = {
    "bert-base": dict(
        hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072, vocab_size=30522
    ),
    "bert-large": dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522
    ),
}
"""BERT's published sizes (Devlin et al., 2019), with the uncased WordPiece vocabulary."""

BERT_DEFAULTS = {"vocab_size": 8192, "max_seq_length": 128}
"""``examples/bert/pretrain.py``'s defaults for the keys of its ``"bert"`` section that change the model."""


def bert_config(spec: str, bert: dict[str, Any], vocab_size: Optional[int] = None) -> dict[str, Any]:
    """The ``BertConfig`` keys of ``spec``, a preset name or a ``BertConfig`` JSON file. The vocabulary is
    ``vocab_size`` if given, else a preset's, else (as ``examples/bert/pretrain.py`` sizes its tokenizer) the
    ``"bert"`` section's ``vocab_size`` (default 8192); the position embeddings cover its ``max_seq_length``."""
    section = {**BERT_DEFAULTS, **bert}
    if spec in PRESETS:
        keys = dict(PRESETS[spec])
    else:
        path = Path(spec)
        if not path.is_file():
            raise ValueError(f"--model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a BertConfig JSON file")
        try:
            keys = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"--model {spec}: not JSON ({err})") from None
        if not isinstance(keys, dict) or "hidden_size" not in keys:
            raise ValueError(
                f"--model {spec}: not a BertConfig JSON (an object with hidden_size, num_hidden_layers...)"
            )
        keys["vocab_size"] = section["vocab_size"]
    if vocab_size is not None:
        keys["vocab_size"] = vocab_size
    seq = section["max_seq_length"]
    return {**keys, "max_position_embeddings": max(keys.get("max_position_embeddings", 512), seq)}


def bert_on(keys: dict[str, Any], device: torch.device) -> nn.Module:
    """``BertForPreTraining(BertConfig(**keys))`` built on ``device`` (the meta device: no memory, no initialisation
    cost), in training mode; keys it cannot be built from raise a ``ValueError`` naming why."""
    from transformers import BertConfig, BertForPreTraining

    try:
        with torch.device(device):
            model = BertForPreTraining(BertConfig(**keys))
    except Exception as err:  # noqa: BLE001 (transformers' and torch's refusals of the keys, named in one line)
        reason = " ".join(str(err).split())
        raise ValueError(f"the model's BertConfig keys cannot build BertForPreTraining: {reason}") from None
    return model.train()


def bert_on_meta(keys: dict[str, Any]) -> tuple[nn.Module, list[dict[str, Any]]]:
    """:func:`bert_on` the meta device, and its param groups as ``examples/bert/pretrain.py`` passes them."""
    model = bert_on(keys, torch.device("meta"))
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if n.endswith("bias") or "LayerNorm" in n]
    decay = [p for n, p in named if not (n.endswith("bias") or "LayerNorm" in n)]
    return model, [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def bert_batches(
    keys: dict[str, Any], micro_batch: int, seq: int, device: torch.device, count: int = 4, seed: int = 0
) -> list[dict[str, torch.Tensor]]:
    """``count`` random pre-training micro-batches of ``micro_batch`` sequences of ``seq`` tokens, 15% of them
    masked-LM targets (``examples/bert/pretrain.py``'s shapes, not its data: the timing does not depend on it)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(keys["vocab_size"], (micro_batch, seq), generator=generator)
        masked = torch.rand(micro_batch, seq, generator=generator) < 0.15
        out.append(
            {
                "input_ids": ids.to(device),
                "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(micro_batch, seq).to(device),
                "attention_mask": torch.ones(micro_batch, seq, dtype=torch.long, device=device),
                "labels": torch.where(masked, ids, torch.full_like(ids, -100)).to(device),
                "next_sentence_label": torch.randint(2, (micro_batch,), generator=generator).to(device),
            }
        )
    return out
