"""The two models of the experiment: a small CNN and a small character transformer."""

from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two conv layers and a classifier for 8x8 digits (~30k parameters)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 48), nn.ReLU(), nn.Linear(48, classes))

    def forward(self, x):
        return self.head(self.features(x))


class CharTransformer(nn.Module):
    """A 2-layer causal transformer over characters (~100k parameters)."""

    def __init__(self, vocab: int, d: int = 64, heads: int = 4, layers: int = 2, context: int = 64):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids):
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        h = self.blocks(self.embed(ids) + self.pos[:n], mask=mask, is_causal=True)
        return self.out(h)


def text_batch(ids: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """Random windows: inputs (batch, context) and next-character targets."""
    start = torch.randint(0, len(ids) - context - 1, (batch,), generator=gen)
    idx = start[:, None] + torch.arange(context + 1)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


@torch.no_grad()
def perplexity(model: CharTransformer, ids: torch.Tensor, context: int, windows: int = 64) -> float:
    gen = torch.Generator().manual_seed(1234)
    x, y = text_batch(ids, windows, context, gen)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, model.out.out_features), y.reshape(-1))
    return math.exp(loss.item())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()
