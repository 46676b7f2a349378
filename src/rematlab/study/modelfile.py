"""Predictor files we can load without trusting them: sizes before, structure after.

skops refuses types it was not told to trust, but a file made only of trusted types can
still be hostile: a zip member that inflates to gigabytes, a fitted entry replaced by `None`,
or a tree whose child indices point outside its node array (scikit-learn's compiled tree
walkers read memory there and crash the process, which no `except` can catch). So a file is
checked twice: its archive before skops opens it (`check_archive`), and the loaded object
graph before anything predicts with it (`check_state`). Every refusal is a `ConfigError`
naming the file.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.tree._tree import Tree
from sklearn.utils.validation import check_is_fitted

from rematlab.exceptions import ConfigError

MAX_UNCOMPRESSED = 1 << 30  # bytes a predictor file may inflate to (the seed study's: ~20 MB)
MAX_RATIO = 200  # inflated / stored bytes of one member above 1 MiB (trees compress ~10x)
_SMALL = 1 << 20
TARGETS = ("time", "memory")
STATE_KEYS = {"names", "fitted", "half_width", "coverage"}


def check_archive(path: Path) -> None:
    """Refuse a file that is no zip, or whose members would inflate beyond the limits,
    before a byte of it is decompressed."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ConfigError(f"predictor file {path} is not a rematlab predictor "
                          f"({type(exc).__name__})") from None
    total = sum(m.file_size for m in members)
    if total > MAX_UNCOMPRESSED:
        raise ConfigError(f"predictor file {path} inflates to {total} bytes, over the "
                          f"{MAX_UNCOMPRESSED} a predictor may hold")
    for m in members:
        if m.file_size > _SMALL and m.file_size > MAX_RATIO * max(1, m.compress_size):
            raise ConfigError(f"predictor file {path}: member {m.filename!r} inflates "
                              f"{m.file_size / max(1, m.compress_size):.0f}x (a zip bomb?)")


def translated(path: Path, renamed: dict[str, str]) -> bytes:
    """The file's bytes with its schema's module names mapped through `renamed`: predictor
    files written before the package moved into subpackages name their classes by the old
    module (`rematlab.predictor.Roofline`), and skops looks classes up by the names a file
    holds. Only exact module names are mapped, so the trusted-type check still sees every
    type the file would construct."""

    def renamed_in(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: renamed.get(v, v) if k == "__module__" and isinstance(v, str)
                    else renamed_in(v) for k, v in node.items()}
        if isinstance(node, list):
            return [renamed_in(v) for v in node]
        return node

    out = io.BytesIO()
    try:
        with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
            for member in src.infolist():
                data = src.read(member)
                if member.filename == "schema.json":
                    data = json.dumps(renamed_in(json.loads(data))).encode()
                dst.writestr(member, data)
    except (zipfile.BadZipFile, OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"predictor file {path} is not a rematlab predictor "
                          f"({type(exc).__name__})") from None
    return out.getvalue()


def check_state(path: Path, state: Any, models: dict[str, list[str]]) -> None:
    """Refuse a loaded state that is not what `Predictor.save` writes: the four entries,
    one fitted estimator per target named in `models`, finite interval widths, and trees
    whose node arrays only point inside themselves."""

    def bad(why: str) -> ConfigError:
        return ConfigError(f"predictor file {path} is not a rematlab predictor ({why})")

    if not isinstance(state, dict) or set(state) != STATE_KEYS:
        raise bad("wrong top-level entries")
    names, fitted, widths = state["names"], state["fitted"], state["half_width"]
    if not all(isinstance(d, dict) for d in (names, fitted, widths)):
        raise bad("entries are not tables")
    if not set(names) == set(fitted) == set(widths) or not set(names) <= set(TARGETS) \
            or not names:
        raise bad("targets do not match")
    coverage = state["coverage"]
    if not isinstance(coverage, float) or not 0.0 < coverage < 1.0:
        raise bad("coverage is not a fraction")
    for target, estimator in fitted.items():
        if names[target] not in models[target]:
            raise bad(f"unknown model {names[target]!r} for {target}")
        width = widths[target]
        if not isinstance(width, float) or not math.isfinite(width) or width < 0:
            raise bad(f"interval width of {target} is not a finite number")
        if not isinstance(estimator, BaseEstimator):
            raise bad(f"{target} holds {type(estimator).__name__}, not a fitted estimator")
        try:
            check_is_fitted(estimator)
        except Exception as exc:  # NotFittedError, or attributes of the wrong kind
            raise bad(f"{target} is not fitted: {type(exc).__name__}") from None
        for problem in _tree_problems(estimator):
            raise bad(f"{target}: {problem}")


def _walk(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """Every object reachable from `obj` through estimator attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, dict):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif isinstance(obj, BaseEstimator):
        children = vars(obj).values()
    else:
        return
    for child in children:
        yield from _walk(child, seen)


def _tree_problems(estimator: BaseEstimator) -> Iterator[str]:
    for obj in _walk(estimator):
        if isinstance(obj, Tree):
            yield from _sklearn_tree(obj)
        elif isinstance(obj, HistGradientBoostingRegressor):
            n_features = int(getattr(obj, "n_features_in_", 0))
            for stage in getattr(obj, "_predictors", []):
                for predictor in stage:
                    yield from _hist_tree(predictor, n_features)


def _children_ok(left: np.ndarray, right: np.ndarray, leaf: np.ndarray) -> bool:
    """Inner nodes point to two later nodes of the array (trees are stored depth first, so
    this also rules out cycles); leaves point nowhere a walker would follow."""
    n = left.size
    idx = np.arange(n)
    inner = ~leaf
    return bool(np.all((left[inner] > idx[inner]) & (left[inner] < n)
                       & (right[inner] > idx[inner]) & (right[inner] < n)))


def _sklearn_tree(tree: Tree) -> Iterator[str]:
    n = int(tree.node_count)
    left, right = np.asarray(tree.children_left), np.asarray(tree.children_right)
    feature = np.asarray(tree.feature)
    if n < 1 or left.size != n or right.size != n or feature.size != n \
            or np.asarray(tree.value).shape[0] != n:
        yield "a tree's node arrays disagree in length"
        return
    leaf = left == -1
    if not np.array_equal(leaf, right == -1) or not _children_ok(left, right, leaf):
        yield "a tree's child indices point outside it"
    if np.any((feature[~leaf] < 0) | (feature[~leaf] >= tree.n_features)):
        yield "a tree splits on a feature it does not have"


def _hist_tree(predictor: Any, n_features: int) -> Iterator[str]:
    nodes = getattr(predictor, "nodes", None)
    if not isinstance(nodes, np.ndarray) or nodes.dtype.names is None or nodes.size < 1:
        yield "a boosted tree has no node array"
        return
    leaf = nodes["is_leaf"].astype(bool)
    if not _children_ok(nodes["left"].astype(np.int64), nodes["right"].astype(np.int64), leaf):
        yield "a boosted tree's child indices point outside it"
    feature = nodes["feature_idx"].astype(np.int64)[~leaf]
    if np.any((feature < 0) | (feature >= n_features)):
        yield "a boosted tree splits on a feature it does not have"
    categorical = ~leaf & nodes["is_categorical"].astype(bool)
    bitsets = min(len(predictor.binned_left_cat_bitsets), len(predictor.raw_left_cat_bitsets))
    if np.any(nodes["bitset_idx"][categorical].astype(np.int64) >= bitsets):
        yield "a boosted tree's category sets point outside it"
