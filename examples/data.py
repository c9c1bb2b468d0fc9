"""Synthetic, learnable, seed-deterministic data for the example training scripts.

* :class:`ShapesCaptions` -- image-text pairs: an image with one coloured shape (square,
  disc, triangle, cross) at one of four positions on a noisy background, and the caption
  that describes it ("<bos> a red disc at top left <eos>"). A vision-language model can
  only predict the colour/shape/position words by looking at the image, so a falling loss
  shows the ViT -> LM path learns.
* :class:`CountingText` -- token sequences of short arithmetic progressions modulo the
  vocabulary, with a random start and stride per sequence: next-token prediction becomes
  easy once the model has seen two tokens, so the loss falls within tens of steps.

Both are indexable by global sample index and depend only on (seed, index), so every rank
of every layout draws the same samples -- the property the equivalence tests rely on.

Real data: subclass :class:`SampleSource` (``__getitem__(i) -> dict`` with ``tokens``
(S,) long, ``labels`` (S,) long with -100 where no loss is taken, and for VLMs
``pixels`` (3, H, W) float) and pass it to the training loop:
``train_loop.main(qwen2_vl.TASK, source=MySource(...))`` (``examples/train_loop.py``); sample
``i`` must not depend on the rank, so every layout trains on the same data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

IGNORE = -100

COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.2), "blue": (0.1, 0.3, 0.9), "yellow": (0.9, 0.9, 0.1)}
SHAPES = ("square", "disc", "triangle", "cross")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
SPECIALS = ("<pad>", "<bos>", "<eos>", "<img>", "a", "at")


def caption_vocab() -> list[str]:
    words = list(SPECIALS) + list(COLOURS) + list(SHAPES)
    for pos in POSITIONS:
        words += [w for w in pos.split() if w not in words]
    return words


class SampleSource:
    """Interface of a dataset the example loop can train on."""

    def __len__(self) -> int:  # pragma: no cover - interface
        raise TypeError("SampleSource subclasses define __len__")

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:  # pragma: no cover - interface
        raise TypeError("SampleSource subclasses define __getitem__")


@dataclass
class ShapesCaptions(SampleSource):
    """Image-caption pairs. ``seq`` is the caption length in tokens (padded).

    ``image_tokens``: the token ids that stand for the image in the text, placed before
    the caption (for Qwen2-VL: vision start, one image pad per visual token, vision end;
    :meth:`braid.models.qwen2_vl.Qwen2VLConfig.image_tokens`); they take no loss.

    ``image_sizes``: square image sides to draw each sample's from (uniformly, by seed and
    index: :meth:`side`) instead of ``image_size``; ``image_tokens`` is then a mapping from
    side to that image's token ids, and every sample is right-padded (``<pad>``, no loss) to
    the longest image's ids plus ``seq``.
    """

    image_size: int
    seq: int
    vocab_size: int
    seed: int = 0
    size: int = 1 << 30
    image_tokens: tuple[int, ...] | dict[int, tuple[int, ...]] = ()
    image_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.words = caption_vocab()
        if self.vocab_size < len(self.words):
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the caption vocabulary ({len(self.words)} words)")
        if self.seq < 10:
            raise ValueError(f"caption sequence length must be >= 10 tokens, got {self.seq}")
        for side in self.image_sizes or (self.image_size,):
            if side < 8 or side % 4:
                raise ValueError(f"image size must be a multiple of 4 and >= 8, got {side}")
        if self.image_sizes and set(self.image_tokens) != set(self.image_sizes):
            raise ValueError("image_sizes needs image_tokens as a mapping from each side to its token ids")
        self.index = {w: i for i, w in enumerate(self.words)}

    def side(self, i: int) -> int:
        """Sample ``i``'s image side: ``image_size``, or one of ``image_sizes`` drawn by (seed, i) alone (cheap:
        a run's sides are known before any image is drawn)."""
        if not self.image_sizes:
            return self.image_size
        return self.image_sizes[random.Random(self.seed * 1_000_003 + i).randrange(len(self.image_sizes))]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        colour = list(COLOURS)[int(torch.randint(len(COLOURS), (1,), generator=g))]
        shape = SHAPES[int(torch.randint(len(SHAPES), (1,), generator=g))]
        pos = int(torch.randint(len(POSITIONS), (1,), generator=g))
        n = self.side(i)
        img = 0.15 * torch.rand(3, n, n, generator=g)
        half = n // 2
        y0, x0 = (pos // 2) * half, (pos % 2) * half
        yy, xx = torch.meshgrid(torch.arange(half, dtype=torch.float32), torch.arange(half, dtype=torch.float32), indexing="ij")
        c = (half - 1) / 2
        r = half * 0.35
        if shape == "square":
            mask = ((yy - c).abs() <= r) & ((xx - c).abs() <= r)
        elif shape == "disc":
            mask = (yy - c) ** 2 + (xx - c) ** 2 <= r * r
        elif shape == "triangle":
            mask = (yy >= c - r) & (yy <= c + r) & ((xx - c).abs() <= (yy - (c - r)) / 2)
        else:
            mask = (((yy - c).abs() <= r / 3) & ((xx - c).abs() <= r)) | (((xx - c).abs() <= r / 3) & ((yy - c).abs() <= r))
        rgb = torch.tensor(COLOURS[colour]).view(3, 1, 1)
        patch = img[:, y0:y0 + half, x0:x0 + half]
        img[:, y0:y0 + half, x0:x0 + half] = torch.where(mask, rgb.expand(3, half, half), patch)
        words = ["<bos>", "a", colour, shape, "at", *POSITIONS[pos].split(), "<eos>"]
        ids = [self.index[w] for w in words]
        tokens = torch.full((self.seq,), self.index["<pad>"], dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids)
        labels = torch.full((self.seq,), IGNORE, dtype=torch.long)
        labels[: len(ids) - 1] = tokens[1: len(ids)]
        image = self.image_tokens[n] if self.image_sizes else self.image_tokens
        if image:
            tokens = torch.cat([torch.tensor(image, dtype=torch.long), tokens])
            labels = torch.cat([torch.full((len(image),), IGNORE, dtype=torch.long), labels])
        if self.image_sizes:  # one length for every sample: the longest image's ids + seq, the rest right-padded
            pad = max(len(t) for t in self.image_tokens.values()) - len(image)
            tokens = torch.cat([tokens, torch.full((pad,), self.index["<pad>"], dtype=torch.long)])
            labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.long)])
        return {"tokens": tokens, "labels": labels, "pixels": img}


@dataclass
class CountingText(SampleSource):
    """Arithmetic progressions modulo ``vocab_size``: learnable next-token prediction."""

    seq: int
    vocab_size: int
    seed: int = 0
    size: int = 1 << 30

    def __post_init__(self) -> None:
        if self.vocab_size < 8 or self.seq < 2:
            raise ValueError(f"need vocab_size >= 8 and seq >= 2, got {self.vocab_size}, {self.seq}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(self.vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 5, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq + 1)) % self.vocab_size
        return {"tokens": seq[:-1].clone(), "labels": seq[1:].clone()}


def batch(source: SampleSource, first: int, count: int) -> dict[str, torch.Tensor]:
    """Stack samples ``first .. first+count-1`` into one micro-batch."""
    items = [source[first + k] for k in range(count)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}
