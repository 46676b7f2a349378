"""Models with more than one stack of layers, each stack of its own class: Hugging Face
encoder-decoders built from small configs (no downloads), and a user's own encoder-decoder
that transformers knows nothing of. Each factory returns (model, example batch)."""

import torch
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    T5Config,
    T5ForConditionalGeneration,
    WhisperConfig,
    WhisperForConditionalGeneration,
)

_TOKENS = {"vocab_size": 97, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
           "decoder_start_token_id": 2, "attn_implementation": "eager"}


def _text(batch: int, seq: int) -> dict:
    ids = torch.randint(3, 97, (batch, seq))
    return {"input_ids": ids, "labels": torch.randint(3, 97, (batch, seq))}


def _seq2seq(config: type, model: type, batch: int, seq: int, layers: int, width: int
             ) -> tuple[nn.Module, dict]:
    """BART and Marian: encoder and decoder layers of two classes, alike in size."""
    cfg = config(encoder_layers=layers, decoder_layers=layers, d_model=width,
                 encoder_attention_heads=4, decoder_attention_heads=4,
                 encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                 max_position_embeddings=max(64, seq), **_TOKENS)
    return model(cfg), _text(batch, seq)


def bart(batch: int = 4, seq: int = 32, layers: int = 3, width: int = 64
         ) -> tuple[nn.Module, dict]:
    return _seq2seq(BartConfig, BartForConditionalGeneration, batch, seq, layers, width)


def marian(batch: int = 4, seq: int = 32, layers: int = 3, width: int = 64
           ) -> tuple[nn.Module, dict]:
    return _seq2seq(MarianConfig, MarianMTModel, batch, seq, layers, width)


def whisper(batch: int = 4, frames: int = 64, layers: int = 3, width: int = 64
            ) -> tuple[nn.Module, dict]:
    cfg = WhisperConfig(encoder_layers=layers, decoder_layers=layers, d_model=width,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=2 * width, decoder_ffn_dim=2 * width,
                        num_mel_bins=16, max_source_positions=frames // 2,
                        max_target_positions=64, **_TOKENS)
    labels = torch.randint(3, 97, (batch, frames // 2))
    return WhisperForConditionalGeneration(cfg), {
        "input_features": torch.randn(batch, 16, frames), "labels": labels}


def t5(batch: int = 4, seq: int = 32, layers: int = 3, width: int = 64
       ) -> tuple[nn.Module, dict]:
    cfg = T5Config(num_layers=layers, num_decoder_layers=layers, d_model=width, d_kv=16,
                   num_heads=4, d_ff=2 * width, **_TOKENS)
    return T5ForConditionalGeneration(cfg), _text(batch, seq)


class EncoderLayer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(width), nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class DecoderLayer(nn.Module):
    """Reads the encoder's output (`memory`) as well as its own stream."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(2 * width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        both = torch.cat([self.norm(y), memory.mean(1, keepdim=True).expand_as(y)], -1)
        return y + self.out(torch.tanh(self.mix(both)))


class EncoderDecoder(nn.Module):
    """A user's own encoder-decoder: two stacks of two classes, two inputs."""

    def __init__(self, width: int = 64, layers: int = 3) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(EncoderLayer(width) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(width) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            src = layer(src)
        for layer in self.decoder:
            tgt = layer(tgt, src)
        return self.head(tgt)


def own(batch: int = 8, seq: int = 32, width: int = 64) -> tuple[nn.Module, tuple]:
    return EncoderDecoder(width), (torch.randn(batch, seq, width), torch.randn(batch, seq, width))


MODELS = {"bart": bart, "marian": marian, "whisper": whisper, "t5": t5, "own": own}
