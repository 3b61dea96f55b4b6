"""BERT masked LM + next-sentence prediction with Hugging Face ``Trainer`` and K-FAC: ``ds_kfac.hf.KFACTrainer``.

The only change from a plain ``transformers.Trainer`` script is the class. The
DeepSpeed config given as ``--deepspeed`` (``TrainingArguments(deepspeed=...)``)
holds the ``"kfac"`` section; its ``"auto"`` values are filled by Trainer::

    deepspeed --num_gpus 2 examples/bert/finetune_trainer.py --deepspeed configs/bert_cpu_trainer_kfac.json
    deepspeed --num_gpus 1 examples/bert/finetune_trainer.py --deepspeed configs/bert_cpu_trainer_kfac.json
    deepspeed --num_gpus 2 examples/bert/finetune_trainer.py --deepspeed configs/bert_cpu_trainer_kfac.json \\
        --resume-from-checkpoint runs/finetune_trainer/checkpoint-30

The model is the tiny BERT of ``configs/bert/bert-tiny.json``, trained on the
embedded corpus of ``corpora.py`` (the docstrings of Python's standard library,
no download) with the pretraining example's sentence pairs and dynamic masks.
Trainer logs K-FAC's metrics (``kfac/steps``, ``kfac/seconds/<phase>``, ...)
beside the loss, and its checkpoints (``<output-dir>/checkpoint-<step>/``) hold
K-FAC's state, so ``--resume-from-checkpoint`` continues with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForPreTraining, TrainingArguments

sys.path.insert(0, str(Path(__file__).parent))
import masking  # noqa: E402
import pairing  # noqa: E402
import sources  # noqa: E402
import wordpiece  # noqa: E402
from pretrain import ROOT  # noqa: E402
from run_data import rank_zero_first  # noqa: E402

import ds_kfac  # noqa: E402
from ds_kfac.hf import KFACTrainer  # noqa: E402

SEQ, VOCAB = 64, 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config with a 'kfac' section")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/finetune_trainer"))
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank and micro-batch")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--bf16", action="store_true", help="bf16 on GPUs (transformers refuses it on CPU)")
    parser.add_argument("--resume-from-checkpoint", help="a Trainer checkpoint directory (checkpoint-<step>)")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    ds_kfac.init_distributed()  # deepspeed.init_distributed, refusing a stale build lock instead of hanging

    train_docs, _ = pairing.split_documents(sources.load_corpus(), held_out_fraction=0.05)
    cache = args.output_dir / "tokenizer-cache"
    tokenizer = rank_zero_first(lambda: wordpiece.train_tokenizer(train_docs, VOCAB, cache_dir=cache))  # rank 0 trains
    train_set = masking.PretrainingDataset(pairing.build_examples(train_docs, tokenizer, SEQ, seed=0), tokenizer, seed=0)
    model_config = json.loads((ROOT / "configs/bert/bert-tiny.json").read_text())
    model_config.update(vocab_size=len(tokenizer))
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**model_config))

    training_args = TrainingArguments(
        output_dir=str(args.output_dir),
        deepspeed=args.deepspeed,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.lr,
        weight_decay=0.01,
        adam_epsilon=1e-6,
        warmup_steps=max(1, args.max_steps // 10),
        bf16=args.bf16,
        logging_steps=10,
        save_steps=args.max_steps // 2,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = KFACTrainer(model=model, args=training_args, train_dataset=train_set, data_collator=masking.collate)
    # BertForPreTraining averages its loss over each micro-batch and ignores Trainer's token count: without this,
    # Trainer would neither divide the loss by the accumulation steps nor leave it unmultiplied by the ranks.
    trainer.model_accepts_loss_kwargs = False
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if dist.get_rank() == 0:
        print(f"K-FAC steps {trainer.kfac.steps}, Trainer steps {trainer.state.global_step}, {result.metrics}")
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
