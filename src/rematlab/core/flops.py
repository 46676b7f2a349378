"""FLOPs: the one home of torch's `FlopCounterMode` and its formulas in rematlab.

torch's formulas count attention whose key and value have fewer heads than the query
(grouped-query attention: Llama, Qwen2, Mistral) only from torch 2.13 on; torch 2.11 and
older raise `sdpa_flop_count: query/key/value shapes are incompatible` inside the counter,
which stopped every profile of such a model (`tests/data/gpu/h200-torch2.11`). The kernels
broadcast each key/value head over its group of query heads, so the work is that of the query's
heads: `GQA_FORMULAS` expands the key and value shapes to them and counts with torch's own
functions, on every torch version.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

aten = flop_counter.aten


def _heads_of_query(query: tuple, kv: tuple) -> tuple:
    """`kv`'s shape with the query's heads (b, h, s, d), as the kernel broadcasts it."""
    if len(query) == len(kv) == 4 and kv[1] != query[1]:
        return (kv[0], query[1], *kv[2:])
    return tuple(kv)


def sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Forward attention FLOPs, grouped-query heads included."""
    return flop_counter.sdpa_flop_count(query_shape, _heads_of_query(query_shape, key_shape),
                                        _heads_of_query(query_shape, value_shape))


def sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args,
                        out_shape=None, **kwargs) -> int:
    """Backward attention FLOPs, grouped-query heads included."""
    return flop_counter.sdpa_backward_flop_count(
        grad_out_shape, query_shape, _heads_of_query(query_shape, key_shape),
        _heads_of_query(query_shape, value_shape))


GQA_FORMULAS: dict = {
    **{op: sdpa_flops for op in (aten._scaled_dot_product_efficient_attention,
                                 aten._scaled_dot_product_flash_attention,
                                 aten._scaled_dot_product_cudnn_attention)},
    **{op: sdpa_backward_flops for op in (aten._scaled_dot_product_efficient_attention_backward,
                                          aten._scaled_dot_product_flash_attention_backward,
                                          aten._scaled_dot_product_cudnn_attention_backward)},
}


def counter() -> FlopCounterMode:
    """A silent `FlopCounterMode` that counts grouped-query attention on every torch."""
    return FlopCounterMode(display=False, custom_mapping=GQA_FORMULAS)


def formula(packet) -> Callable | None:
    """The FLOP formula of an op (its overload packet), called as the registry's are
    (`formula(*args, **kwargs, out_val=out)`); None for an op with none."""
    if packet in GQA_FORMULAS:
        return flop_counter.shape_wrapper(GQA_FORMULAS[packet])
    return flop_counter.flop_registry.get(packet)
