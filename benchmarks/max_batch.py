"""The largest batch that fits one CPU memory cap, without remat and with the optimal plan,
and the throughput of each: the six zoo models and two transformers.

    python benchmarks/max_batch.py [--cap 512MiB] [--out docs/benchmarks/max-batch.md]

Each row is one `rematlab.max_batch` call: the batch is exact by measurement (it fits, one
more sample does not), and the two cases are timed side by side, interleaved round by round,
so their throughput ratio survives a busy machine; a case whose spread (IQR / median) exceeds
10 % is marked noisy. The transformers are built from configs (no downloads): a GPT-2-style
language model and a BERT-style classifier, 6 layers of width 256, sequences of 128 tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rematlab.core.units import format_bytes, parse_bytes
from rematlab.measurement import zoo
from rematlab.planning.maxbatch import BatchSearch, max_batch

ZOO = [("mlp3", None), ("mlp5", None), ("mlp7", None), ("lenet5", None),
       ("alexnet", "cifar"), ("vgg16", "cifar")]
SEQ, VOCAB = 128, 8192
NOISY = 0.10


def gpt2() -> tuple[torch.nn.Module, dict]:
    cfg = GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def bert() -> tuple[torch.nn.Module, dict]:
    cfg = BertConfig(num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                     intermediate_size=1024, vocab_size=VOCAB, max_position_embeddings=SEQ,
                     num_labels=4, pad_token_id=0, attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (4, SEQ), generator=gen)
    return BertForSequenceClassification(cfg), {
        "input_ids": ids, "attention_mask": torch.ones_like(ids),
        "labels": torch.randint(0, 4, (4,), generator=gen)}


def models():
    for name, inp in ZOO:
        torch.manual_seed(0)
        net, shape, _ = zoo.resolve(name, inp)
        yield name, net, torch.randn(8, *shape)
    for name, factory in (("gpt2 (6x256, seq 128)", gpt2), ("bert (6x256, seq 128)", bert)):
        torch.manual_seed(0)
        net, batch = factory()
        yield name, net, batch


def row(name: str, found: BatchSearch) -> str:
    none, best = found.fit("none"), found.fit("optimal")

    def speed(f) -> str:
        if not f.throughput:
            return ""
        noisy = " (noisy)" if f.step_iqr / f.step_s > NOISY else ""
        return f"{f.throughput:.1f} ± {f.throughput * f.step_iqr / f.step_s:.1f}{noisy}"

    gain = f"{best.batch / none.batch - 1:+.0%}" if none.batch else "n/a"
    ratio = (f"{best.throughput / none.throughput:.2f}" if best.throughput and none.throughput
             else "")
    plan = best.plan or ""
    plan = f"`{plan[:40]}{'…' if len(plan) > 40 else ''}`" if plan else ""
    return (f"| {name} | {none.batch} | {best.batch} | {gain} | {format_bytes(none.peak or 0)} "
            f"/ {format_bytes(best.peak or 0)} | {speed(none)} | {speed(best)} | {ratio} | "
            f"{plan} | {found.search_s:.1f} | {none.measured + best.measured} | "
            f"{found.timing_s:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap", default="512MiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    cap = parse_bytes(args.cap)
    torch.set_num_threads(os.cpu_count() or 1)
    lines, t0, load0 = [], time.perf_counter(), os.getloadavg()[0]
    for name, net, example in models():
        found = max_batch(net.train(), example, cap, repeats=args.repeats, warmup=1)
        lines.append(row(name, found))
        print(lines[-1], flush=True)
    total, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    text = "\n".join([
        "# The largest batch under a CPU memory cap, without and with remat",
        "",
        f"Command: `python benchmarks/max_batch.py --cap {args.cap} --repeats {args.repeats}"
        f"{' --out ' + str(args.out) if args.out else ''}` ({total:.0f} s in all).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
        f"{load0:.2f} before, {load1:.2f} after (above the core count means other work ran "
        f"beside this; the throughput ratios are side by side and stay fair).",
        "",
        f"Cap {format_bytes(cap)} for every model: the whole step's peak (parameters, "
        "gradients, momentum-SGD state, batch, activations, output alive) as rematlab "
        "measures it. *batch*: the largest that fits — measured, with one more sample "
        "measured over the cap. *samples/s*: batch / median step time (forward, loss, "
        f"backward, optimizer) over {args.repeats} interleaved rounds, ± IQR. *x*: "
        "throughput with remat over without. *search*: wall seconds to find both batches "
        "(model profiled at two small batches, re-profiled near its answer, then measured); "
        "*measured*: batch sizes measured to confirm; *timing*: seconds spent timing.",
        "",
        "| model | batch none | batch remat | gain | peak none / remat | samples/s none | "
        "samples/s remat | x | plan | search (s) | measured | timing (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
        "",
    ])
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
