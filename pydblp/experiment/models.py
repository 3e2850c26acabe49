"""The experiment's models: a small CNN and a wide MLP on digits, two character transformers.

``MODELS`` names them as the CLI does: ``digits`` (CNN, ~30k parameters),
``mlp`` (digits, ~1.1M parameters: 4.5 MB of gradient a step, so communication
dominates a step at 1 Gbit/s), ``text`` (transformer, ~100k parameters) and ``lm``
(the transformer widened to ~1.16M parameters over a 32-character context, 4 windows a
rank and step: ~10 ms of compute against 4.6 MB of gradient, communication dominates).
"""

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


class DigitsMLP(nn.Module):
    """Two wide hidden layers for 8x8 digits (``width`` 1024: ~1.1M parameters)."""

    def __init__(self, classes: int = 10, width: int = 1024):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


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


MODELS = ("digits", "mlp", "text", "lm")
DIGITS_MODELS = ("digits", "mlp")  # trained on the digits data set, measured by accuracy (else perplexity)
BATCH = {"lm": 4}  # samples per rank and step where not 32
HELDOUT_WINDOWS = 512  # text models: held-out windows evaluated (non-overlapping, the split's first)


def make(name: str, vocab: int = 97) -> nn.Module:
    """A fresh model by its CLI name (seed torch first for the same initial weights on every rank)."""
    if name == "digits":
        return DigitsCNN()
    if name == "mlp":
        return DigitsMLP()
    if name == "text":
        return CharTransformer(vocab)
    if name == "lm":
        return CharTransformer(vocab, d=176, heads=4, layers=3, context=32)
    raise ValueError(f"unknown model {name!r}: use {', '.join(MODELS)}")


def text_batch(ids: torch.Tensor, batch: int, context: int, gen: torch.Generator):
    """Random windows: inputs (batch, context) and next-character targets."""
    start = torch.randint(0, len(ids) - context - 1, (batch,), generator=gen)
    idx = start[:, None] + torch.arange(context + 1)
    w = ids[idx]
    return w[:, :-1], w[:, 1:]


def heldout(ids: torch.Tensor, context: int, windows: int = HELDOUT_WINDOWS):
    """The held-out split's first ``windows`` non-overlapping windows: inputs and next-character
    targets, (windows, context) each; the same on every call (no sampling noise between evaluations)."""
    windows = min(windows, (len(ids) - 1) // context)
    w = ids[: windows * context + 1]
    return w[:-1].reshape(windows, context), w[1:].reshape(windows, context)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Quality on a held-out set: ``loss`` (mean cross-entropy, nats: smooth, what time to target
    is measured on) and beside it ``accuracy`` (classifiers) or ``perplexity`` (language models,
    ``exp(loss)``)."""
    out = model(x)
    if out.dim() == 3:
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).item()
        return {"loss": loss, "perplexity": math.exp(loss)}
    return {"loss": nn.functional.cross_entropy(out, y).item(), "accuracy": (out.argmax(dim=1) == y).float().mean().item()}


@torch.no_grad()
def perplexity(model: CharTransformer, ids: torch.Tensor, context: int, windows: int = 64) -> float:
    gen = torch.Generator().manual_seed(1234)
    x, y = text_batch(ids, windows, context, gen)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, model.out.out_features), y.reshape(-1))
    return math.exp(loss.item())


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(dim=1) == y).float().mean().item()
