"""The embedded image task: digits rendered from the fonts matplotlib ships, distorted, cluttered and noisy.

No download: the glyphs come from the TrueType files in ``matplotlib/mpl-data/fonts`` (DejaVu, STIX and
Computer Modern, 22 faces with digits), rasterised by Pillow (a matplotlib dependency). Each image is one
digit (the class, 10 classes) at 32x32 in colour, as CIFAR-10's maps are:

* a face drawn uniformly, the glyph under a random affine map (rotation, anisotropic scale, shear,
  translation) resampled with ``grid_sample``;
* a neighbouring glyph cut by the image border on a random side (as in a line of text), dimmer;
* random background and foreground colours with a minimum contrast, then Gaussian pixel noise.

Everything is drawn from ``torch.Generator``s seeded by the split and the image index's chunk, so a split
is the same tensor on every machine with the same matplotlib, Pillow and torch versions;
:func:`digest` fingerprints it and the example records it with every run. The training split
(``train_size`` images, 50,000 by default, as CIFAR-10) and the held-out split (10,000) are drawn from the
same distribution with different seeds. Generation takes seconds (about 7 s for 50,000 images on one
core), so nothing is cached on disk.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F

SIZE = 32
"""Side of the images (CIFAR-sized maps)."""
MASTER = 64
"""Side of the rendered glyphs the affine maps sample from."""
CLASSES = "0123456789"
FACES = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
    "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf", "DejaVuSansMono-BoldOblique.ttf",
    "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf", "DejaVuSerif-BoldItalic.ttf",
    "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
    "cmr10.ttf", "cmb10.ttf", "cmss10.ttf", "cmti10.ttf", "cmtt10.ttf", "cmmi10.ttf",
)  # fmt: skip
"""The font files (in matplotlib's ``mpl-data/fonts/ttf``) whose digits make the task, a fixed order."""
SEEDS = {"train": 1, "held_out": 2}
CHUNK = 4096
"""Images drawn per generator: image ``i`` comes from the generator seeded by ``(split, i // CHUNK)``."""


def render_masters() -> torch.Tensor:
    """Every face's every digit as a ``MASTER`` x ``MASTER`` coverage mask in [0, 1], its ink box centred
    and scaled to fill 3/4 of the side: a ``(len(FACES) * 10, 1, MASTER, MASTER)`` tensor, face-major."""
    from PIL import Image, ImageDraw, ImageFont

    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    masters = []
    for face in FACES:
        font = ImageFont.truetype(str(fonts / face), size=2 * MASTER)
        for char in CLASSES:
            canvas = Image.new("L", (4 * MASTER, 4 * MASTER), 0)
            ImageDraw.Draw(canvas).text((MASTER, MASTER), char, fill=255, font=font)
            ink = canvas.crop(canvas.getbbox())
            side = max(ink.size)
            square = Image.new("L", (side, side), 0)
            square.paste(ink, ((side - ink.width) // 2, (side - ink.height) // 2))
            inner = 3 * MASTER // 4
            glyph = square.resize((inner, inner), Image.Resampling.LANCZOS)
            master = Image.new("L", (MASTER, MASTER), 0)
            master.paste(glyph, ((MASTER - inner) // 2, (MASTER - inner) // 2))
            masters.append(torch.from_numpy(np.asarray(master, dtype=np.float32) / 255.0))
    return torch.stack(masters).unsqueeze(1)


def _affine(n: int, g: torch.Generator, scale: tuple[float, float], shift: float) -> torch.Tensor:
    """``n`` random ``affine_grid`` matrices (output -> input coordinates): rotation within 25 degrees, a
    glyph size of ``scale`` of the image per axis (up to 15% anisotropy), shear within 0.3, the glyph's
    centre moved by up to ``shift`` of the half-side."""
    u = torch.rand(n, 6, generator=g)
    angle = (u[:, 0] * 2 - 1) * math.radians(25)
    size = scale[0] + u[:, 1] * (scale[1] - scale[0])
    sx, sy = size * (1 + 0.15 * (2 * u[:, 2] - 1)), size
    shear = (u[:, 3] * 2 - 1) * 0.3
    cos, sin = torch.cos(angle), torch.sin(angle)
    # forward map glyph -> image: R @ [[sx, shear*sx], [0, sy]]; grid_sample wants its inverse.
    fwd = torch.stack(
        [
            torch.stack([cos * sx, cos * shear * sx - sin * sy], 1),
            torch.stack([sin * sx, sin * shear * sx + cos * sy], 1),
        ],
        1,
    )
    inv = torch.linalg.inv(fwd)
    centre = torch.stack([(u[:, 4] * 2 - 1) * shift, (u[:, 5] * 2 - 1) * shift], 1)
    return torch.cat([inv, -(inv @ centre.unsqueeze(2))], 2)


def _chunk(masters: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (uint8, ``(n, 3, SIZE, SIZE)``) and labels drawn with ``g``."""
    faces = len(masters) // len(CLASSES)
    labels = torch.randint(0, len(CLASSES), (n,), generator=g)
    glyph = torch.randint(0, faces, (n,), generator=g) * len(CLASSES) + labels
    # "Full" scale 1 maps the master's MASTER pixels onto SIZE: its glyph (3/4 of the master) spans 3/4 of the image.
    main = F.affine_grid(_affine(n, g, (0.75, 1.15), 0.2), (n, 1, SIZE, SIZE), align_corners=False)
    ink = F.grid_sample(masters[glyph], main, align_corners=False)
    # A neighbour, cut by the border: its centre about one glyph width away on a random side.
    other = torch.randint(0, len(masters), (n,), generator=g)
    theta = _affine(n, g, (0.75, 1.15), 0.15)
    side = torch.randint(0, 4, (n,), generator=g)
    away = 1.2 + 0.4 * torch.rand(n, generator=g)
    direction = torch.stack([torch.cos(side * math.pi / 2), torch.sin(side * math.pi / 2)], 1)
    theta[:, :, 2] -= (theta[:, :, :2] @ (away.unsqueeze(1) * direction).unsqueeze(2)).squeeze(2)
    near = F.grid_sample(
        masters[other], F.affine_grid(theta, (n, 1, SIZE, SIZE), align_corners=False), align_corners=False
    )
    dim = 0.4 + 0.5 * torch.rand(n, 1, 1, 1, generator=g)
    coverage = torch.maximum(ink, dim * near)
    # Colours with a minimum contrast of 0.35 in mean intensity between glyph and background.
    background = torch.rand(n, 3, 1, 1, generator=g)
    foreground = torch.rand(n, 3, 1, 1, generator=g)
    gap = foreground.mean(1, keepdim=True) - background.mean(1, keepdim=True)
    push = (0.35 - gap.abs()).clamp(min=0) * torch.where(gap >= 0, 1.0, -1.0)
    foreground = (foreground + push).clamp(0, 1)
    background = (background - push).clamp(0, 1)
    image = background + (foreground - background) * coverage
    image = image + 0.12 * torch.randn(n, 3, SIZE, SIZE, generator=g)
    return (image.clamp(0, 1) * 255).round().to(torch.uint8), labels


def generate(split: str, size: int, masters: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``size`` images of ``split`` (``"train"`` or ``"held_out"``) and their labels: uint8
    ``(size, 3, SIZE, SIZE)`` and int64 ``(size,)``. A prefix of a larger split is the smaller one."""
    if split not in SEEDS:
        raise ValueError(f"split must be one of {sorted(SEEDS)}, got {split!r}")
    masters = render_masters() if masters is None else masters
    images, labels = [], []
    for start in range(0, size, CHUNK):
        g = torch.Generator().manual_seed(SEEDS[split] * 1_000_003 + start // CHUNK)
        x, y = _chunk(masters, CHUNK, g)
        images.append(x[: size - start])
        labels.append(y[: size - start])
    return torch.cat(images), torch.cat(labels)


MEAN, STD = 0.5, 0.25
"""The normalisation the example applies (``(x / 255 - MEAN) / STD``, every channel)."""


def load(
    train_size: int = 50_000, held_out_size: int = 4_000
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Training and held-out images as normalised float32 tensors, their labels, and the digest of all four."""
    masters = render_masters()
    x_tr, y_tr = generate("train", train_size, masters)
    x_te, y_te = generate("held_out", held_out_size, masters)
    norm = lambda x: (x.to(torch.float32) / 255.0 - MEAN) / STD  # noqa: E731
    return norm(x_tr), y_tr, norm(x_te), y_te, digest(x_tr, y_tr, x_te, y_te)


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' bytes (the uint8 images and labels): what a run records to name its data."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()
