"""ResNet training with DeepSpeed and K-FAC: ``deepspeed.initialize`` swapped for ``ds_kfac.initialize``.

Launch as any DeepSpeed script::

    deepspeed --num_gpus 2 examples/resnet/train.py --deepspeed_config configs/resnet_kfac_cpu.json
    deepspeed --num_gpus 2 examples/resnet/train.py --deepspeed_config configs/resnet_easgd_cpu.json
    deepspeed --num_gpus 8 examples/resnet/train.py --deepspeed_config configs/resnet32_cifar10_kfac.json \\
        --cifar10-dir /data/cifar-10-batches-py --depth 32 --epochs 100

Data: ``--cifar10-dir`` reads the CIFAR-10 "python version" batches
(``data_batch_1..5``, ``test_batch``). Without it, the embedded default
(``--data glyphs``, :mod:`glyphs`) is 50,000 training and 4,000 held-out
32x32 colour images of digits rendered from the fonts matplotlib ships, under
random affine distortions, a neighbouring glyph as clutter and pixel noise,
generated deterministically in seconds with nothing to download: enough data
for global batches of thousands, and hard enough not to saturate within the
budget; its digest is printed and recorded. ``--data digits`` is
scikit-learn's bundled 8x8 digits (``--held-out-fraction`` 0.6 held out,
random shifts of up to ``--shift`` pixels on every training batch): 718
training images, too few for large batches. Whether K-FAC is on, and how, is
the config's ``"kfac"`` section; everything else (batch size, accumulation,
ZeRO, bf16/fp16, optimizer, scheduler) is ordinary DeepSpeed config.

The held-out set is evaluated in shards, one per rank, with rank 0's
BatchNorm statistics (broadcast first, as DistributedDataParallel does), and
the sums all-reduced.

The config may carry a ``"resnet"`` section (read here, not passed to
DeepSpeed): ``steps`` or ``epochs``, the run's budget, so that a config whose
learning-rate schedule is compressed (``WarmupDecayLR``'s ``total_num_steps``)
also says how long it runs. ``--steps`` and ``--epochs`` override it. A
``"client_optimizer"`` section (``{"class": "pytorch_optimizer.SOAP", "params":
{...}}``) replaces the ``"optimizer"`` section with any ``torch.optim.Optimizer``
(:func:`ds_kfac.optimizers.client.pop_client_optimizer`; both sections are refused), passed to
``ds_kfac.initialize``.

Every run writes ``<output-dir>/<run-name>/metrics.csv``: per step the
training seconds (evaluation is not timed), loss and learning rate, and the
held-out accuracy and loss every ``--eval-every`` steps and at the end.

With an ``"easgd"`` section (synchronous EASGD: each rank trains its own
weights, tied to a center), the held-out metrics are those of the center,
swapped into the model for evaluation, and rank 0 saves the center to
``<output-dir>/<run-name>/center.pt`` at the end (``{parameter name: tensor}``;
BatchNorm statistics are rank 0's own).
"""

from __future__ import annotations

import argparse
import csv
import json
import pickle
import sys
import time
from pathlib import Path

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ds_kfac
from ds_kfac.config.json_values import json_object

sys.path.insert(0, str(Path(__file__).parent))
import glyphs  # noqa: E402


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet (He et al. 2016): depth 6n+2, widths 16/32/64."""

    def __init__(self, depth: int, in_channels: int, classes: int, width: int = 16) -> None:
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"--depth must be 6n+2 (8, 20, 32, 56, ...), got {depth}")
        n = (depth - 2) // 6
        self.conv = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (i > 0 and j == 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(F.relu(self.bn(self.conv(x))))
        return self.fc(F.adaptive_avg_pool2d(out, 1).flatten(1))


def load_cifar10(directory: Path) -> tuple[torch.Tensor, ...]:
    """CIFAR-10 python batches as float images normalised per channel, and labels."""

    def read(name: str) -> tuple[np.ndarray, np.ndarray]:
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"--cifar10-dir {directory}: missing {name} (expected the CIFAR-10 python version)")
        with path.open("rb") as f:
            batch = pickle.load(f, encoding="bytes")
        if b"data" not in batch or b"labels" not in batch:
            raise ValueError(f"{path}: not a CIFAR-10 python batch (no b'data'/b'labels' keys)")
        return np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32), np.asarray(batch[b"labels"])

    train = [read(f"data_batch_{i}") for i in range(1, 6)]
    x_tr, y_tr = np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train])
    x_te, y_te = read("test_batch")
    mean = x_tr.reshape(-1, 3, 1024).mean(axis=(0, 2)).reshape(1, 3, 1, 1) / 255
    std = x_tr.reshape(-1, 3, 1024).std(axis=(0, 2)).reshape(1, 3, 1, 1) / 255
    norm = lambda x: torch.tensor((x / 255.0 - mean) / std, dtype=torch.float32)  # noqa: E731
    return norm(x_tr), torch.tensor(y_tr), norm(x_te), torch.tensor(y_te)


def load_digits_default(seed: int, held_out_fraction: float = 0.6) -> tuple[torch.Tensor, ...]:
    """The embedded default: scikit-learn's digits, a stratified ``held_out_fraction`` held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, torch.tensor(digits.target), test_size=held_out_fraction, random_state=seed, stratify=digits.target
    )
    return x_tr, y_tr, x_te, y_te


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Each image translated by its own integer offset in ``[-max_shift, max_shift]`` per axis, zero filled."""
    if max_shift == 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, n), generator=generator).tolist()
    return torch.stack([padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w] for i in range(n)])


METRICS_FIELDS = ["step", "seconds", "loss", "lr", "held_out_accuracy", "held_out_loss"]


def evaluate(
    engine: deepspeed.DeepSpeedEngine, x: torch.Tensor, y: torch.Tensor, batch: int = 500
) -> tuple[float, float]:
    """Held-out accuracy and loss of the model with rank 0's BatchNorm statistics, each rank evaluating
    its shard ``x[rank::world]`` and the sums all-reduced (the same numbers on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for buffer in engine.module.buffers():
        dist.broadcast(buffer, src=0)
    engine.eval()
    x, y = x[rank::world], y[rank::world]
    dtype = next(engine.module.parameters()).dtype
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = engine(x[i : i + batch].to(engine.device, dtype)).float().cpu()
            target = y[i : i + batch]
            sums[0] += (logits.argmax(1) == target).sum()
            sums[1] += F.cross_entropy(logits, target, reduction="sum").double()
            sums[2] += len(target)
    dist.all_reduce(sums)
    engine.train()
    return float(sums[0] / sums[2]), float(sums[1] / sums[2])


def evaluate_model(engine: deepspeed.DeepSpeedEngine, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """:func:`evaluate` on the model a run produces: with EASGD, the center."""
    easgd = getattr(engine, "easgd", None)
    if easgd is None:
        return evaluate(engine, x, y)
    with easgd.center_swapped_in():
        return evaluate(engine, x, y)


def read_config(path: Path) -> tuple[dict, dict]:
    """The DeepSpeed config at ``path`` and its ``"resnet"`` section (``steps``, ``epochs``), or an exit with one line
    naming the file and what is wrong (not JSON, not an object, an unknown key)."""
    try:
        config = json_object(json.loads(path.read_text()), str(path))
        budget = json_object(config.pop("resnet", {}), str(path), "resnet")
    except (OSError, json.JSONDecodeError) as error:
        sys.exit(f"train.py: error: {path}: cannot read the config ({error})")
    except ValueError as error:  # json_object names the file
        sys.exit(f"train.py: error: {error}")
    unknown = set(budget) - {"steps", "epochs"}
    if unknown:
        sys.exit(f"train.py: error: {path}: unknown keys {sorted(unknown)} in 'resnet' (allowed: steps, epochs)")
    return config, budget


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cifar10-dir", type=Path, help="CIFAR-10 python batches; default: the embedded --data")
    parser.add_argument("--data", choices=("glyphs", "digits"), default="glyphs", help="embedded data set")
    parser.add_argument("--train-size", type=int, default=50_000, help="glyphs training images")
    parser.add_argument("--held-out-size", type=int, default=4_000, help="glyphs held-out images")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, help="optimizer steps (default: resnet.steps, else --epochs worth)")
    parser.add_argument("--epochs", type=int, help="epochs when no step count is given (default: resnet.epochs, 10)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, data order and augmentation")
    parser.add_argument("--data-seed", type=int, default=0, help="the held-out split (fixed across --seed)")
    parser.add_argument("--held-out-fraction", type=float, default=0.6, help="digits held out (embedded default)")
    parser.add_argument("--shift", type=int, default=2, help="random-shift augmentation in pixels (0: off)")
    parser.add_argument("--eval-every", type=int, default=0, help="held-out evaluation interval (default: 20 per run)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/resnet"))
    parser.add_argument("--run-name", help="default: the config file's name")
    parser.add_argument("--results", type=Path, help="append a JSON line with the final metrics here (rank 0)")
    parser.add_argument("--local_rank", type=int, default=-1)
    ds_kfac.add_config_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)

    data, digest = ("cifar10", None) if args.cifar10_dir else (args.data, None)
    if args.cifar10_dir:
        x_tr, y_tr, x_te, y_te = load_cifar10(args.cifar10_dir)
    elif args.data == "glyphs":
        x_tr, y_tr, x_te, y_te, digest = glyphs.load(args.train_size, args.held_out_size)
    else:
        x_tr, y_tr, x_te, y_te = load_digits_default(args.data_seed, args.held_out_fraction)
    augment = data == "digits"  # random shifts: the glyphs are distorted already, CIFAR-10 runs as stored
    torch.manual_seed(args.seed)
    model = ResNet(args.depth, x_tr.shape[1], 10)
    config, budget = read_config(Path(args.deepspeed_config))
    optimizer = ds_kfac.optimizers.client.pop_client_optimizer(config, model.parameters(), args.seed)
    engine, _, _, _ = ds_kfac.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    global_batch = micro * accum * world
    epochs = args.epochs or budget.get("epochs", 10)
    steps = args.steps or (None if args.epochs else budget.get("steps")) or epochs * (len(x_tr) // global_batch)
    eval_every = args.eval_every or max(1, steps // 20)
    run_dir = args.output_dir / (args.run_name or Path(args.deepspeed_config).stem)
    metrics_csv = run_dir / "metrics.csv"
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        with metrics_csv.open("w", newline="") as f:
            csv.writer(f).writerow(METRICS_FIELDS)
    dtype = next(engine.module.parameters()).dtype
    kfac, easgd = getattr(engine, "kfac", None), getattr(engine, "easgd", None)
    if rank == 0:
        print(
            f"ResNet-{args.depth}, {data} ({digest or 'no digest'}), {len(x_tr)} train / {len(x_te)} held out, {world} ranks x {micro} x {accum} "
            f"accumulation = batch {global_batch}, {steps} steps, K-FAC: {kfac is not None}, "
            f"EASGD: {easgd is not None}",
            flush=True,
        )

    order = torch.Generator().manual_seed(args.seed)
    shifts = torch.Generator().manual_seed(args.seed * 7919 + rank)
    perm, pos, seconds = torch.randperm(len(x_tr), generator=order), 0, 0.0
    for step in range(steps):
        started = time.perf_counter()  # optimizer steps only: evaluation is not timed
        if pos + global_batch > len(perm):
            perm, pos = torch.randperm(len(x_tr), generator=order), 0
        idx = perm[pos : pos + global_batch].view(accum, world, micro)[:, rank]
        pos += global_batch
        total = 0.0
        for m in range(accum):
            x = random_shift(x_tr[idx[m]], args.shift, shifts) if augment else x_tr[idx[m]]
            logits = engine(x.to(engine.device, dtype)).float()
            if kfac is not None:  # with "fisher": "sampled", G from labels drawn from the model's prediction
                kfac.sample_fisher(logits, "cross_entropy")
            loss = F.cross_entropy(logits, y_tr[idx[m]].to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item() / accum
        seconds += time.perf_counter() - started
        row = [step + 1, f"{seconds:.3f}", f"{total:.6f}", f"{engine.get_lr()[0]:.6g}", "", ""]
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            accuracy, test_loss = evaluate_model(engine, x_te, y_te)
            row[4:] = [f"{accuracy:.6f}", f"{test_loss:.6f}"]
            if rank == 0:
                print(
                    f"step {step + 1:>5}  loss {total:.4f}  held-out accuracy {accuracy:.4f}  {seconds:.1f}s",
                    flush=True,
                )
        if rank == 0:
            with metrics_csv.open("a", newline="") as f:
                csv.writer(f).writerow(row)

    if easgd is not None and rank == 0:
        torch.save(easgd.center_state_dict(), run_dir / "center.pt")
    if rank == 0:
        name = " + ".join(n for n, on in (("K-FAC", kfac), ("EASGD", easgd)) if on is not None) or "baseline"
        print(f"{name}: held-out accuracy {accuracy:.4f}, loss {test_loss:.4f}, {seconds:.1f}s", flush=True)
        if args.results:
            with args.results.open("a") as f:
                f.write(
                    json.dumps(
                        {
                            "config": args.deepspeed_config,
                            "data": data,
                            "data_digest": digest,
                            "global_batch": global_batch,
                            "kfac": kfac is not None,
                            "easgd": easgd is not None,
                            "steps": steps,
                            "accuracy": accuracy,
                            "loss": test_loss,
                            "seconds": seconds,
                        }
                    )
                    + "\n"
                )
    ds_kfac.shutdown()


if __name__ == "__main__":
    main()
