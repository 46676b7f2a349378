"""Pre-flight's saved bytes per transformer layer for a CUDA target, against Korthikanti et
al.'s activation formula ("Reducing Activation Recomputation in Large Transformer Models",
2022, eq. 1): s·b·h·(34 + 5·a·s/h) bytes per layer at 16-bit, whose s² term (the attention
probabilities and their dropout mask) flash attention does not save: 34·s·b·h.

A GPT-2-style layer (transformers' GPT-2 with the fused tanh GeLU, `gelu_pytorch_tanh`, as
Megatron fuses it; SDPA attention, dropout 0.1, bf16) is predicted for an H100 target at three
widths, nothing run; then one layer's saved tensors are listed op by op, in the order autograd
saves them, parameters left out (the formula counts activations only).

    .venv/bin/python benchmarks/korthikanti.py --out docs/benchmarks/activation-formula.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rematlab
from benchmarks.publish import publish
from rematlab.preflight.fake import FakeSession

SEQ, BATCH, HEAD = 512, 2, 64
WIDTHS = (256, 512, 1024)


def gpt_layer_model(width: int, layers: int = 2, gelu: str = "gelu_pytorch_tanh"
                    ) -> torch.nn.Module:
    """A GPT-2-style model of `width` on the meta device, in bf16, training mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=width, n_head=width // HEAD, vocab_size=97,
                     n_positions=SEQ, attn_implementation="sdpa", activation_function=gelu)
    with torch.device("meta"):
        return GPT2LMHeadModel(cfg).to(torch.bfloat16).train()


def layer_bytes(width: int, gelu: str = "gelu_pytorch_tanh") -> int:
    """Pre-flight's bytes one layer holds for backward, for an H100: what it saves, its
    input included (the first layer norm saves it)."""
    ids = torch.empty(BATCH, SEQ, dtype=torch.int64, device="meta")
    planning = rematlab.prepare(gpt_layer_model(width, gelu=gelu),
                                {"input_ids": ids, "labels": ids},
                                predict=True, target="h100-80gb",
                                step=rematlab.Step(optimizer=None))
    c = planning.costs
    return c.saved[1] + (c.x[1] if c.keeps_input[1] else 0) + (c.x[2] if c.keeps_output[1]
                                                               else 0)


def saved_tensors(width: int) -> list[tuple[str, str, int]]:
    """One layer's saved activations (shape, dtype, bytes), each storage once, in order."""
    model = gpt_layer_model(width, layers=1)
    session = FakeSession(cuda=True)
    twin = session.model(model)
    params = {id(p.untyped_storage()) for p in twin.parameters()}
    seen: dict[int, tuple[str, str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = id(t.untyped_storage())
        if key not in params and key not in seen:
            seen[key] = (str(tuple(t.shape)), str(t.dtype).removeprefix("torch."),
                         t.untyped_storage().nbytes())
        return t
    with session.active():
        x = torch.empty(BATCH, SEQ, width, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            twin.transformer.h[0](x)
    return list(seen.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = ["| width h | heads a | predicted per layer | 34·s·b·h | ratio |", "|---" * 5 + "|"]
    for width in WIDTHS:
        got, formula = layer_bytes(width), 34 * SEQ * BATCH * width
        rows.append(f"| {width} | {width // HEAD} | {got:,} B | {formula:,} B | "
                    f"{got / formula:.4f} |")
        print(rows[-1], flush=True)
    sbh = SEQ * BATCH * WIDTHS[0]
    python_gelu = layer_bytes(WIDTHS[0], "gelu_new") / (34 * sbh)
    ops = ["| # | shape | dtype | bytes | in s·b·h |", "|---" * 5 + "|"]
    for i, (shape, dtype, nbytes) in enumerate(saved_tensors(WIDTHS[0]), 1):
        ops.append(f"| {i} | {shape} | {dtype} | {nbytes:,} | {nbytes / sbh:.3f} |")
    publish("\n".join([
        "# Saved bytes per layer against Korthikanti et al.'s formula",
        "",
        "Command: `.venv/bin/python benchmarks/korthikanti.py --out "
        "docs/benchmarks/activation-formula.md` (nothing run: fake tensors, predicted for "
        f"`h100-80gb`). s = {SEQ} tokens, b = {BATCH}, head size {HEAD}, bf16, dropout 0.1.",
        "",
        *rows,
        "",
        f"One layer's saved activations at h = {WIDTHS[0]}, in the order autograd saves them "
        "(parameters left out; a tensor saved twice counted once):",
        "",
        *ops,
        "",
        "Against the formula's 34·s·b·h (with flash attention: no s² term):",
        "- the layer's input, saved by the first layer norm: 2 (formula: 2);",
        "- the first layer norm's output, the QKV projection's input: 2 (2);",
        "- q, k and v, one storage, saved by flash attention: 6 (the formula's QKᵀ inputs 4 and "
        "V 2);",
        "- flash attention's output, which is also the output projection's input (a view "
        "after the transpose): 2 (2);",
        "- the bool mask of the dropout after the output projection (`native_dropout`): 1 (1);",
        "- the residual sum, saved by the second layer norm: 2 (2), and its output, the MLP's "
        "input: 2 (2);",
        "- the GeLU's input and output (the second projection's input): 8 + 8 (8 + 8);",
        "- the last dropout's bool mask: 1 (1).",
        "",
        "What the formula leaves out, and makes the difference: each layer norm's mean and "
        "reciprocal standard deviation (s·b values each, four tensors), flash attention's "
        "log-sum-exp (a·s·b fp32 values) and its RNG seed and offset (24 bytes). Attention "
        "dropout runs inside the flash kernel: no mask is saved. transformers' default GPT-2 "
        "activation (`gelu_new`, written as Python ops) saves every intermediate of the tanh "
        f"formula, {python_gelu:.2f}x the formula here; a fused GeLU, as Megatron's, is what "
        "the formula assumes. On a GPU the layer norms' mean and reciprocal standard "
        "deviation are fp32 (the accumulate type of bf16), where the CPU fake tensors keep "
        "them in bf16: 4 x s·b x 2 bytes per layer more on the GPU (8 KiB here).",
        "",
    ]), args.out)


if __name__ == "__main__":
    main()
