"""Any model becomes a chain of blocks.

`nn.Sequential` children are blocks. Other models are traced with `torch.fx`; a cut point is a
node after which the only value still needed downstream is that node's own output (a single
tensor carries all live state forward), and never one whose value the next op changes in
place. Residual stages, inverted bottlenecks and Transformer layers close their skips inside
a block, so they become chain links; a U-Net's long skips span many layers, so it yields
fewer, larger blocks. When tracing fails, the module's children are used if running them in
order reproduces the model's output, and the caller is told which way was taken. Models that
are no chain at all are driven through their layers (`rematlab.remat.layers`).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from rematlab.exceptions import ConfigError
from rematlab.preflight.fake import twin


@dataclass(frozen=True)
class ChainInfo:
    blocks: list[nn.Module]
    method: str  # "sequential", "fx", or "children"


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` on the meta device, made without copying any weight data: its
    parameters, buffers and tensor attributes as meta tensors (tied weights stay tied)."""
    return twin(module, _on_meta)


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    clone = torch.empty_like(t, device="meta")
    return nn.Parameter(clone, t.requires_grad) if isinstance(t, nn.Parameter) else clone


def find_chain(model: nn.Module, example_input: torch.Tensor | None = None,
               quiet: bool = False) -> ChainInfo:
    """Blocks of `model` and how they were found (see module docstring); `quiet` drops the
    warning when the children are used."""
    if isinstance(model, nn.Sequential):
        return ChainInfo(list(model), "sequential")
    try:
        return ChainInfo(trace_blocks(model), "fx")
    except Exception as exc:  # fx raises many kinds of errors on untraceable code
        children = list(model.children())
        if example_input is not None and children and _children_reproduce(model, children,
                                                                            example_input):
            if not quiet:
                warnings.warn(f"tracing failed ({exc.__class__.__name__}: {exc}); using the "
                              "module's children as blocks", stacklevel=2)
            return ChainInfo(children, "children")
        raise ConfigError(f"cannot find a chain of blocks in {type(model).__name__}: tracing "
                         f"failed ({exc}); pass the list of blocks explicitly") from exc


def _children_reproduce(model: nn.Module, children: list[nn.Module], x: torch.Tensor) -> bool:
    with torch.no_grad():
        try:
            want, got = model(x), x
            for child in children:
                got = child(got)
        except Exception:
            return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want)


def trace_blocks(model: nn.Module) -> list[nn.Module]:
    """Cut an fx trace of `model` into single-tensor-boundary blocks (GraphModules sharing the
    model's parameters)."""
    graph = fx.symbolic_trace(model).graph
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise ValueError(f"a chain needs exactly one input, the model takes {len(inputs)}")
    order = {n: i for i, n in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    body = [n for n in nodes if n.op not in ("placeholder", "output")]
    cuts: list[int] = []
    for i, node in enumerate(body):
        if i == len(body) - 1:
            break
        pos = order[node]
        live = [n for n in nodes[: pos + 1] if last_use[n] > pos and n.op != "get_attr"]
        if live == [node] and not any(_mutates(u, node, model) for u in node.users):
            cuts.append(i)
    bounds = [-1, *cuts, len(body) - 1]
    blocks = []
    for a, b in itertools.pairwise(bounds):
        blocks.append(_subgraph(model, body[a + 1: b + 1], inputs[0] if a < 0 else body[a]))
    return blocks


_IN_PLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow",
                       "iand", "ior", "ixor", "ilshift", "irshift", "imatmul"}


def _mutates(user: fx.Node, value: fx.Node, root: nn.Module) -> bool:
    """Whether `user` changes `value` in place (`relu_`, `+=`, `ReLU(inplace=True)`). A block
    boundary is never put before such a use: a checkpointed block would otherwise change the
    input it keeps for recomputation, and profiling would hand it a leaf to modify."""
    if not user.args or user.args[0] is not value:
        return False
    if user.op == "call_module":
        return bool(getattr(root.get_submodule(str(user.target)), "inplace", False))
    name = getattr(user.target, "__name__", str(user.target))
    return (name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__"))
            or bool(user.kwargs.get("inplace", False)))


def _subgraph(root: nn.Module, nodes: list[fx.Node], entry: fx.Node) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {entry: g.placeholder("x")}
    for node in nodes:
        env[node] = g.node_copy(node, lambda n: env[n] if n in env else _get_attr(g, env, n))
    g.output(env[nodes[-1]])
    return fx.GraphModule(root, g)


def _get_attr(g: fx.Graph, env: dict, node: fx.Node) -> fx.Node:
    if node.op != "get_attr":
        raise ValueError(f"value {node.name} crosses a block boundary")
    env[node] = g.node_copy(node)
    return env[node]
