"""The model a sweep measures: the built-in tiny transformer or a user's ``MODULE:FACTORY``."""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from certckpt.errors import ConfigurationError

__all__ = ["BUILTIN_MODEL", "BUILTIN_MODELS", "gpt2_small", "load_factory", "resolve_model", "tiny_transformer"]

BUILTIN_MODEL = "tiny-transformer"


def tiny_transformer(
    *, vocab: int = 256, d_model: int = 64, heads: int = 4, layers: int = 2, mlp_ratio: int = 4, tied: bool = False
):
    """The default model: a small causal language model, so that sequence length matters.

    Token embedding plus fixed sinusoidal positions (no parameter, any length), ``layers`` pre-norm
    blocks (causal self-attention through ``torch.nn.functional.scaled_dot_product_attention``,
    then a GELU MLP), a final layer norm and an LM head; next-token cross-entropy on uniform random
    tokens. About 133k parameters at the defaults. ``tied``: the LM head shares the embedding's
    weight (as GPT-2's does).

    Returns:
        ``(model, batch_fn, loss_fn)``: ``batch_fn(rank, step, seq_len, micro_batch)`` gives
        ``(tokens, targets)``, int64 ``[micro_batch, seq_len]`` each, seeded by (rank, step);
        ``loss_fn(model, batch)`` the mean cross-entropy.
    """
    # torch here, not at the top: the CLI imports this module (resolve_model) before any rank starts.
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.fc1 = nn.Linear(d_model, mlp_ratio * d_model)
            self.fc2 = nn.Linear(mlp_ratio * d_model, d_model)

        def forward(self, x):
            b, n, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class TinyTransformer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab, bias=False)
            if tied:
                # GPT-2's initialisation of a shared embedding (N(0, 1) would give logits of ~30 sigma)
                nn.init.normal_(self.embed.weight, std=0.02)
                self.head.weight = self.embed.weight

        @staticmethod
        def positions(n: int, device, dtype):
            pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
            inv = torch.exp(
                torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d_model)
            )
            pe = torch.zeros(n, d_model, device=device, dtype=torch.float32)
            pe[:, 0::2] = torch.sin(pos * inv)
            pe[:, 1::2] = torch.cos(pos * inv)
            return pe.to(dtype)

        def forward(self, tokens):
            x = self.embed(tokens)
            x = x + self.positions(tokens.shape[1], x.device, x.dtype)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = TinyTransformer()

    def batch_fn(rank: int, step: int, seq_len: int, micro_batch: int):
        g = torch.Generator().manual_seed(rank * 1_000_003 + step)
        t = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=g)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def loss_fn(m, batch):
        tokens, targets = batch
        logits = m(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return model, batch_fn, loss_fn


def gpt2_small():
    """A model people train: GPT-2 small's shape (12 layers, width 768, 12 heads, vocabulary 50,257,
    LM head tied to the embedding), 124M parameters; positions are sinusoidal, as in the tiny model,
    so any sequence length runs. What the envelope measures on a GPU (``--model gpt2-small``), where
    the 133k-parameter default is bound by the host, not the device."""
    return tiny_transformer(vocab=50257, d_model=768, heads=12, layers=12, tied=True)


BUILTIN_MODELS: dict[str, Callable[[], tuple[Any, Callable, Callable]]] = {
    BUILTIN_MODEL: tiny_transformer,
    "gpt2-small": gpt2_small,
}


def resolve_model(spec: str) -> tuple[str, str | None]:
    """Check ``--model`` in the driver: ``tiny-transformer`` or an importable ``MODULE:FACTORY``.

    Returns:
        ``(spec, extra_path)``: the directory the rank processes need on their path to import the
        module (None for the built-in model or an installed module).

    Raises:
        ConfigurationError: malformed, not importable, or not callable (a usage error).
    """
    if spec in BUILTIN_MODELS:
        return spec, None
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name or ":" in fn_name:
        raise ConfigurationError(f"--model: expected {' or '.join(BUILTIN_MODELS)} or MODULE:FACTORY, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` gives the rank processes
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigurationError(f"--model {spec}: cannot import {mod_name!r} ({e})") from None
    if not callable(getattr(mod, fn_name, None)):
        raise ConfigurationError(f"--model {spec}: {mod_name!r} has no callable {fn_name!r}")
    path = getattr(mod, "__file__", None)
    extra = None
    if path:
        root = os.path.dirname(os.path.abspath(path))
        depth = mod_name.count(".") + (1 if os.path.basename(path) == "__init__.py" else 0)
        for _ in range(depth):
            root = os.path.dirname(root)
        extra = root
    return spec, extra


def load_factory(spec: str) -> Callable[[], tuple[Any, Callable, Callable]]:
    """The factory a rank calls for ``(model, batch_fn, loss_fn)``; ``spec`` was checked by :func:`resolve_model`."""
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    mod_name, _, fn_name = spec.partition(":")
    return getattr(importlib.import_module(mod_name), fn_name)
