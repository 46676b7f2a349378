"""Offload's mechanism (issue 61, `rematlab.remat.offload`) on this CPU, where it runs as on a
GPU but synchronously: the gradients equal the plain model's exactly (float64), what moves is
what the module docstring says (activations, never parameters or a layer's inputs), a graph
kept for a second backward reloads again, and host buffers go back to the pool."""

import gc

import pytest
import torch
import transformers
from torch import nn

from rematlab.exceptions import ConfigError
from rematlab.remat.offload import OffloadedLayers, Offloader


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=128,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).double().train()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return _grads(model)


def test_gradients_equal_the_plain_models_with_every_layer_offloaded():
    ids = torch.randint(0, 128, (4, 32))
    plain = _step(_gpt2(), ids)
    model = _gpt2()
    moved = OffloadedLayers(model, list(model.transformer.h), min_bytes=0)
    got = _step(model, ids)
    assert got.keys() == plain.keys()
    assert all(torch.equal(got[k], plain[k]) for k in plain)
    stats = moved.offloader.stats
    assert stats.tensors > 0 and stats.device_bytes > 0
    gc.collect()
    assert stats.host_now == 0  # the graph is freed: every buffer back in the pool
    before = moved.offloader.pool.allocations
    assert all(torch.equal(v, plain[k]) for k, v in _step(model, ids).items())
    assert moved.offloader.pool.allocations == before  # the second step reuses the buffers


def test_parameters_and_a_layers_inputs_stay_and_activations_move():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).double()
    model = nn.Sequential(layer)
    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    moved = OffloadedLayers(model, [layer], min_bytes=0)
    out = model(x)
    stats = moved.offloader.stats
    # saved: x and W1 (kept: the input, a parameter), the first linear's output (GELU's
    # input) and GELU's output (the second linear's input), W2 (kept)
    assert stats.tensors == 2 and stats.device_bytes == 2 * 8 * 64 * 8
    out.sum().backward()
    ref = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).double()
    ref.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(layer[0].weight.grad, ref[0].weight.grad)


def test_small_tensors_stay_below_the_threshold():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).double()
    moved = OffloadedLayers(nn.Sequential(layer), [layer])  # 1 MiB: these are 4 KiB
    layer(torch.randn(8, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert moved.offloader.stats.tensors == 0


def test_a_graph_kept_for_a_second_backward_reloads_again():
    model = _gpt2()
    OffloadedLayers(model, list(model.transformer.h), min_bytes=0)
    ids = torch.randint(0, 128, (2, 32))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = _grads(model)
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert all(torch.equal(first[k], v) for k, v in _grads(model).items())


def test_no_grad_forwards_and_removal_leave_nothing_behind():
    model = _gpt2()
    moved = OffloadedLayers(model, list(model.transformer.h), min_bytes=0)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 32)))
    assert moved.offloader.stats.tensors == 0
    moved.remove()
    ids = torch.randint(0, 128, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert moved.offloader.stats.tensors == 0


def test_bad_arguments_are_refused_in_one_line():
    model = _gpt2()
    with pytest.raises(ConfigError, match="min_bytes"):
        Offloader.for_model(model, min_bytes=-1)
    with pytest.raises(ConfigError, match="non-empty"):
        OffloadedLayers(model, [])
    with pytest.raises(ConfigError, match="submodule"):
        OffloadedLayers(model, [nn.Linear(2, 2)])
