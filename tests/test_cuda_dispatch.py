"""Pre-flight for a CUDA target runs the ops a CUDA step dispatches (issue 40): the fused
dropout with its bool mask, flash attention forward and backward, the optimizer's multi-tensor
update, on CPU fake tensors (no fake CUDA tensor, which aborts the process under autograd),
through the forward, backward and the recomputation of checkpointed layers."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import rematlab
from benchmarks.korthikanti import BATCH, SEQ, layer_bytes
from rematlab.preflight.cuda_ops import CudaDispatch
from rematlab.preflight.targets import Target, resolve_target
from tests.clirun import run


def _gpt2() -> torch.nn.Module:  # dropout 0.1 on residuals, embeddings and attention
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=97,
                                      n_positions=64, attn_implementation="sdpa"))


def _llama() -> torch.nn.Module:  # grouped-query heads, attention dropout inside SDPA
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
        attention_dropout=0.1, attn_implementation="sdpa"))


def _ops(factory, target: str | Target) -> set[str]:
    """The aten ops a pre-flight plan for `target` ran, the floor plan's whole step included
    (its layers' recomputation in backward)."""
    torch.manual_seed(0)
    model = factory().to(torch.bfloat16).train()
    ids = torch.randint(0, 97, (2, 64))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        planning = rematlab.prepare(model, {"input_ids": ids, "labels": ids}, predict=True,
                                    target=target,
                                    step=rematlab.Step(optimizer=torch.optim.AdamW))
        floor = planning.solution.frontier[0]
        if planning.target.kind == "cuda":  # its whole step on the card, recomputation too
            planning.card(floor)
    assert floor.segments  # a layer was checkpointed, so recomputed in backward
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("factory", [_gpt2, pytest.param(_llama, marks=pytest.mark.slow)],
                         ids=["gpt2", "llama"])
def test_a_cuda_target_runs_the_ops_cuda_dispatches(factory):
    ops = _ops(factory, "h100-80gb")
    assert {"aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward",
            "aten::_foreach_addcmul_", "aten::_foreach_lerp_"} <= ops
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in ops
    if factory is _gpt2:
        assert {"aten::native_dropout", "aten::native_dropout_backward"} <= ops
        assert "aten::bernoulli_" not in ops  # CPU's dropout: a mask in the input's dtype


@pytest.mark.slow
def test_a_cpu_target_keeps_the_cpu_ops():
    # uncalibrated: a calibrated CPU target measures kernels' scratch under a profiler of its
    # own (`preflight.workspace`), which would stop this one
    ops = _ops(_gpt2, replace(resolve_target("cpu"), calibrated=False))
    assert "aten::bernoulli_" in ops  # the CPU's dropout
    assert not {"aten::native_dropout", "aten::_scaled_dot_product_flash_attention"} & ops
    assert not any(op.startswith("aten::_foreach_") for op in ops)


def test_the_dispatch_is_scoped_and_patches_nothing():
    sdpa = F.scaled_dot_product_attention
    x = torch.randn(4, 8)
    # CUDA's kernels have fake implementations on the CPU, not real ones
    with FakeTensorMode(allow_non_fake_inputs=True), CudaDispatch():
        from torch.nn.functional import scaled_dot_product_attention  # a direct import too

        q = torch.empty(1, 2, 4, 8, dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            scaled_dot_product_attention(q, q, q)
            F.dropout(x, 0.5)
        names = {e.name for e in prof.events()}
    assert {"aten::_scaled_dot_product_flash_attention", "aten::native_dropout"} <= names
    assert F.scaled_dot_product_attention is sdpa  # nothing patched, nothing left behind
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.dropout(x, 0.5)
    assert "aten::native_dropout" not in {e.name for e in prof.events()}


@pytest.mark.parametrize("width", [256, 512, 1024])
def test_saved_bytes_per_layer_match_korthikantis_formula(width):
    """34·s·b·h bytes per GPT-style layer at 16-bit with flash attention (no s² term;
    docs/benchmarks/activation-formula.md lists the few tensors the formula leaves out):
    within 1 %, well inside the 10 % the issue asks."""
    formula = 34 * SEQ * BATCH * width
    assert formula <= layer_bytes(width) <= 1.01 * formula


def test_a_model_that_moves_to_cuda_itself_fails_cleanly(tmp_path):
    """Pre-flight makes no fake CUDA tensor, but a model's own `.cuda()` would: on this CPU
    build that must be one error line and exit 2, never an abort (run as a child process,
    which an abort would kill with a signal)."""
    (tmp_path / "cudamodel.py").write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class ToCuda(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n"
        "        return (self.lin(x).cuda() * 2).cpu()\n\n\n"
        "def make():\n"
        "    return nn.Sequential(ToCuda(), ToCuda())\n")
    proc = run(["plan", "--model", "cudamodel:make", "--input-shape", "8", "--batch", "4",
                "--predict", "--target", "h100-80gb", "--budget", "1GiB"], cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-500:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "cuda" in lines[0], lines


def test_op_level_options_for_a_cuda_target_name_the_ops_cuda_runs():
    """An op-level option saves ops by name and fingerprints the block's op sequence, so one
    made for a CUDA target must see CUDA's: the fused dropout and flash attention."""
    from rematlab.preflight.fake import FakeSession
    from rematlab.preflight.targets import PROFILES
    from rematlab.remat.ops import fingerprint, profile_ops

    layer = _gpt2().to(torch.bfloat16).train().transformer.h[0]
    seen = {}
    for cuda in (True, False):
        session = FakeSession(cuda=cuda)
        twin = session.model(layer)
        with session.active():
            x = session.tensor(torch.empty(2, 64, 128, dtype=torch.bfloat16)).requires_grad_()

            def run(v, twin=twin):
                out = twin(v)
                return out[0] if isinstance(out, tuple) else out
            seen[cuda] = [o.name for o in profile_ops(twin, run, x,
                                                       target=PROFILES["h100-80gb"])]
    assert {"aten.native_dropout.default",
            "aten._scaled_dot_product_flash_attention.default"} <= set(seen[True])
    assert not any("bernoulli" in n or "for_cpu" in n for n in seen[True])
    assert any("bernoulli" in n for n in seen[False])  # CPU dropout, a mask in bf16
    assert fingerprint(seen[True]) != fingerprint(seen[False])  # a CPU plan is refused


def test_a_cuda_targets_autocast_follows_cudas_policy_not_the_cpus():
    """Issue 49: under bf16 autocast a CUDA step runs pow, softmax, layer_norm and sum in fp32
    (`autocast_mode.cpp`'s CUDA lists) and einsum in bf16; the CPU's policy keeps the first in
    bf16. Pre-flight for a CUDA target applies CUDA's, differentiably,
    and only inside the autocast region."""
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu = [F.softmax(x, -1), x ** 3, F.layer_norm(x, (8,))]
        with CudaDispatch():
            cuda = [F.softmax(x, -1), x ** 3, F.layer_norm(x, (8,)), x.sum(),
                    torch.einsum("ij,jk->ik", w, w), F.gelu(x),
                    x.softmax(-1, dtype=torch.bfloat16)]
    assert [t.dtype for t in cpu] == [torch.bfloat16] * 3
    assert [t.dtype for t in cuda] == [torch.float32] * 4 + [torch.bfloat16] * 3
    sum(t.float().sum() for t in cuda[:4]).backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    with CudaDispatch():  # no autocast region: nothing cast
        assert F.softmax(x, -1).dtype == torch.bfloat16


def test_grouped_query_attention_flops_count_on_every_torch():
    """torch 2.11's FlopCounterMode raised on key/value with fewer heads than the query
    (`tests/data/gpu/h200-torch2.11`): rematlab's formulas count them as the query's heads."""
    from rematlab.core.flops import formula, sdpa_backward_flops, sdpa_flops

    q, kv = (2, 8, 16, 32), (2, 2, 16, 32)
    assert sdpa_flops(q, kv, kv) == sdpa_flops(q, q, q) > 0
    assert sdpa_backward_flops(q, q, kv, kv) == sdpa_backward_flops(q, q, q, q) > 0
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    with FakeTensorMode():
        query, key = torch.empty(q), torch.empty(kv)
        out = torch.empty(q)
    assert formula(op)(query, key, key, None, True, out_val=(out,)) == sdpa_flops(q, q, q)
