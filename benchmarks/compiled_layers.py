"""Plans for transformers models under torch.compile, at three budgets (issue 25).

    python benchmarks/compiled_layers.py [--out docs/benchmarks/compiled-layers.md]

GPT-2 and Llama from transformers configs (4 layers, width 128, batch 8 x 128 tokens,
dropout off so that compiled and eager draw no masks), each planned once with
`rematlab.prepare(model, batch, compile=True)`. Budgets: the compiled floor (measured), the
midpoint, and the compiled plain step's peak less one byte. For each: the plan, its compiled
step peak as the planner measured it (the c10 allocator's events, which see inside compiled
code), and the largest gradient difference of `torch.compile(apply(model, plan))` against
`torch.compile(model)` on the same batch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import rematlab
from rematlab.core.batch import call
from rematlab.core.steps import default_loss
from rematlab.core.units import format_bytes
from rematlab.exceptions import InfeasibleBudgetError
from rematlab.remat.block import compiling
from rematlab.study.tables import markdown_table

MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(
        n_layer=4, n_embd=128, n_head=4, vocab_size=512, n_positions=128, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager")),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=384, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=128,
        attn_implementation="eager")),
}


def _grads(run, model, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    default_loss(call(run, batch), batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _row(name: str, planning, budget: int, model, batch, want) -> dict:
    chosen = planning.choose(budget)
    with compiling():  # past dynamo's recompile limit the model would silently run eager
        got = _grads(torch.compile(rematlab.apply(model, chosen)), model, batch)
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    return {"model": name, "budget": format_bytes(budget), "plan": chosen.describe(),
            "compiled peak": format_bytes(chosen.measured_peak or 0),
            "within budget": "yes" if (chosen.measured_peak or 0) <= budget else "NO",
            "max grad difference": f"{diff:.1e}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="docs/benchmarks/compiled-layers.md")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows, started = [], time.perf_counter()
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build().train()
        ids = torch.randint(0, 512, (8, 128))
        batch = {"input_ids": ids, "labels": ids}
        t0 = time.perf_counter()
        planning = rematlab.prepare(model, batch, compile=True)
        top = planning.choose(planning.full * 2).measured_peak or 0
        try:
            floor = planning.choose(planning.floor_budget()).measured_peak or 0
        except InfeasibleBudgetError as exc:
            floor = exc.min_peak
        with compiling():
            want = _grads(torch.compile(model), model, batch)
        for budget in (floor, (floor + top) // 2, top - 1):
            rows.append(_row(name, planning, budget, model, batch, want))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    text = (
        "# Per-layer plans under torch.compile\n\n"
        f"Produced by `python benchmarks/compiled_layers.py` on this 2-core CPU "
        f"({time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s of wall time in "
        "all, compilation included; no time is compared here, only peaks and gradients). "
        "Each model is planned once with `compile=True`; each budget's plan is verified on "
        "the compiled whole step and trained compiled against the compiled plain model "
        "(float32; the difference is the compiled kernels' rounding).\n\n"
        + markdown_table(pd.DataFrame(rows)) + "\n")
    Path(args.out).write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
