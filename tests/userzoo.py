"""User models for tests: factories reachable as `tests.userzoo:NAME`."""

import torch
from torch import nn


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class ResNetLike(nn.Module):
    """Stem, three residual blocks, head: fx finds one cut after each residual sum."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.stages = nn.ModuleList(Residual(width) for _ in range(3))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.head(x)


def resnet_like() -> nn.Module:
    return ResNetLike()


class UNetLike(nn.Module):
    """A long skip from the first to the last layer: no cut can lie inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.a(x))
        y = torch.relu(self.b(skip))
        y = self.c(y) + skip
        return self.head(y)


def unet_like() -> nn.Module:
    return UNetLike()


class Untraceable(nn.Module):
    """Data-dependent control flow defeats torch.fx; its children still form the chain."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.c = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if x.sum() < -1e30:  # never true, but fx cannot know
            x = -x
        return self.c(self.b(x))


class TinyTransformer(nn.Module):
    """Pre-norm Transformer encoder layers on (B, T, D) inputs, mean-pooled head."""

    def __init__(self, dim: int = 16, layers: int = 2, classes: int = 3) -> None:
        super().__init__()
        self.norms1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, 2, batch_first=True)
                                  for _ in range(layers))
        self.norms2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                nn.Linear(2 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for n1, attn, n2, mlp in zip(self.norms1, self.attn, self.norms2, self.mlps,
                                     strict=True):
            h = n1(x)
            x = x + attn(h, h, h, need_weights=False)[0]
            x = x + mlp(n2(x))
        return self.head(x.mean(dim=1))


def killed_by_the_kernel() -> nn.Module:
    """What the OOM killer does to a worker: SIGKILL, no exception, no message."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


def slow() -> nn.Module:
    """A model whose construction outlives any short timeout."""
    import time

    time.sleep(60)
    return tiny()


def exits():
    """A factory that ends its process's interpreter (not an Exception a measurement records):
    the worker reports it and the sweep records an error, not an OOM."""
    raise SystemExit(3)


class Decoder(nn.Module):
    """Token ids in, a stack of repeated layers driven by its own loop."""

    def __init__(self, vocab: int = 50, dim: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))
            for _ in range(3))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx)  # (B, T, dim)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h).mean(1)  # (B, vocab)


def decoder() -> nn.Module:
    return Decoder()


def decoder_batch(batch: int) -> torch.Tensor:
    return torch.randint(0, 50, (batch, 8))


def narrow_cnn() -> nn.Sequential:
    """Eight 3x3 convolutions of 16 channels on 32x32 images: activations outweigh the
    weights many times over, as in VGG-16, at a fraction of its cost."""
    blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 16, 16, 3, padding=1), nn.ReLU())
              for i in range(8)]
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return nn.Sequential(*blocks, head)


def meta_llama() -> nn.Module:
    """A small Llama built on the meta device: no weight is allocated (pre-flight planning)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                      max_position_embeddings=128)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def announced() -> nn.Module:
    """A deep MLP whose factory says "built" on stderr: a test knows the command has
    started working, past the interpreter's imports, before it interrupts it."""
    import sys

    sys.stderr.write("built\n")
    sys.stderr.flush()
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(24)))


def interrupted_inside_c() -> nn.Module:
    """A factory hit by Ctrl-C while C code runs Python (CPython's `PyRun_String`): CPython
    then marks the KeyboardInterrupt unhandled, however it is caught."""
    import ctypes

    run = ctypes.pythonapi.PyRun_String
    run.restype = ctypes.py_object
    run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    run(b"raise KeyboardInterrupt", 257, {}, {})  # 257: Py_file_input
    raise AssertionError("unreachable")
