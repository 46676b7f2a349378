"""Models nobody here wrote the way rematlab would like: Hugging Face transformers built from
configs (no downloads), a torchvision-style ResNet with in-place ReLU, a U-Net, and a
decoder with several inputs whose forward fx cannot trace. Each factory returns (model,
example batch)."""

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)


def gpt2(batch: int = 4, seq: int = 32, layers: int = 4, width: int = 64
         ) -> tuple[nn.Module, dict]:
    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=97,
                     n_positions=max(64, seq),
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    ids = torch.randint(0, 97, (batch, seq))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def padded_batches(steps: int, batch: int = 4, seed: int = 0) -> list[dict]:
    """Token batches as a dynamic-padding collator makes them for the GPT-2 above: each as
    long as its longest sequence, lengths drawn from 40-128."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        length = int(torch.randint(40, 129, (1,), generator=gen))
        ids = torch.randint(0, 97, (batch, length), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _causal_lm(config_cls: type, model_cls: type, batch: int, seq: int, layers: int,
               width: int = 64) -> tuple[nn.Module, dict]:
    """A decoder with grouped-query attention (Qwen2, Llama) from a small config."""
    cfg = config_cls(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                     max_position_embeddings=max(64, seq), attn_implementation="eager")
    ids = torch.randint(0, 97, (batch, seq))
    return model_cls(cfg), {"input_ids": ids, "labels": ids}


def qwen2(batch: int = 4, seq: int = 32, layers: int = 4) -> tuple[nn.Module, dict]:
    return _causal_lm(Qwen2Config, Qwen2ForCausalLM, batch, seq, layers)


def llama(batch: int = 4, seq: int = 32, layers: int = 2, width: int = 64
          ) -> tuple[nn.Module, dict]:
    return _causal_lm(LlamaConfig, LlamaForCausalLM, batch, seq, layers, width)


def bert(batch: int = 4, seq: int = 32, layers: int = 4, width: int = 64
         ) -> tuple[nn.Module, dict]:
    cfg = BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=4,
                     intermediate_size=2 * width, vocab_size=97,
                     max_position_embeddings=max(64, seq),
                     num_labels=3, pad_token_id=0, attn_implementation="eager")
    ids = torch.randint(1, 97, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, seq // 2:] = 0
    return BertForSequenceClassification(cfg), {
        "input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (batch,))}


class Bottleneck(nn.Module):
    """torchvision's Bottleneck: `out += identity` and a shared in-place ReLU."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.conv2 = nn.Conv2d(c // 2, c // 2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c // 2)
        self.conv3, self.bn3 = nn.Conv2d(c // 2, c, 1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(*(Bottleneck(width) for _ in range(blocks)))
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))  # (B, C, H, W)
        x = self.layer1(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def resnet(batch: int = 8, size: int = 16) -> tuple[nn.Module, torch.Tensor]:
    return ResNet(), torch.randn(batch, 3, size, size)


class UNet(nn.Module):
    """Encoder-decoder with long skips; the output is an image (B, C, H, W)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()

        def conv(i: int, o: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

        self.enc1, self.enc2, self.mid = conv(3, c), conv(c, 2 * c), conv(2 * c, 2 * c)
        self.dec2, self.dec1 = conv(4 * c, c), conv(2 * c, c)
        self.pool, self.up = nn.MaxPool2d(2), nn.Upsample(scale_factor=2)
        self.out = nn.Conv2d(c, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)  # (B, c, H, W)
        e2 = self.enc2(self.pool(e1))  # (B, 2c, H/2, W/2)
        m = self.mid(self.pool(e2))  # (B, 2c, H/4, W/4)
        d2 = self.dec2(torch.cat([self.up(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up(d2), e1], 1))
        return self.out(d1)  # (B, 3, H, W)


def unet(batch: int = 4, size: int = 32) -> tuple[nn.Module, torch.Tensor]:
    return UNet(), torch.randn(batch, 3, size, size)


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Several inputs (tokens, positions, padding) and a positional parameter sliced by the
    sequence length: torch.fx cannot trace it."""

    def __init__(self, vocab: int = 50, dim: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, 64, dim) * 0.02)
        self.layers = nn.ModuleList(Layer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, shift: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:, :t] + shift[:, None, None]
        causal = torch.full((t, t), float("-inf"), dtype=x.dtype).triu(1)
        for layer in self.layers:
            x = layer(x, causal)
        return self.head(x) * pad[..., None]  # (B, T, vocab)


def decoder(batch: int = 4, seq: int = 24) -> tuple[nn.Module, tuple]:
    return Decoder(), (torch.randint(0, 50, (batch, seq)), torch.randn(batch),
                       torch.ones(batch, seq))


class Encoder(nn.Module):
    """torch's own `nn.TransformerEncoder`, which torch.fx keeps whole as one leaf."""

    def __init__(self, vocab: int = 97, dim: int = 64, layers: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))  # (B, 10)


def encoder(batch: int = 8, seq: int = 32) -> tuple[nn.Module, torch.Tensor]:
    return Encoder(), torch.randint(0, 97, (batch, seq))


MODELS = {"gpt2": gpt2, "bert": bert, "resnet": resnet, "unet": unet, "decoder": decoder}
