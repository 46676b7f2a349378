"""Predict step time and peak memory of a configuration before running it.

Features come from shape propagation on the meta device (no compute, no memory): the chain's
per-block costs (`profile_chain` on meta), the strategy's plan over them, and the plan's
simulated peak — the analytic memory model of `rematlab.plans.plan`, itself a predictor. Learned
models sit on top, as scikit-learn pipelines saved with skops (never pickle):

- `sgd`, `rf`: the original study's baselines (SGDRegressor, RandomForestRegressor) on the
  study's kind of inputs — the configuration itself (architecture, batch, strategy, dtype,
  device) — and raw targets;
- `gbr`: gradient boosting on log targets over the analytic features;
- `analytic`: memory only, the simulated peak as is;
- `analytic+gbr`: the analytic peak times a learned correction (boosting on the log residual).

Evaluation splits by configuration (the dataset's summary has one row per configuration, so
repeats of one configuration never straddle train and test).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.base import BaseEstimator, RegressorMixin, clone
from sklearn.compose import ColumnTransformer
from sklearn.ensemble import HistGradientBoostingRegressor, RandomForestRegressor
from sklearn.linear_model import LinearRegression, SGDRegressor
from sklearn.metrics import mean_absolute_percentage_error, r2_score
from sklearn.model_selection import KFold, LeaveOneGroupOut, cross_val_predict
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler
from sklearn.utils.validation import check_is_fitted

from rematlab.core.files import write_atomic
from rematlab.exceptions import ConfigError
from rematlab.measurement.spec import Spec
from rematlab.study.features import (
    ANALYTIC,
    CONFIG_CATEGORICAL,
    CONFIG_NUMERIC,
    MIN_FIT,
    dataset,
    features,
)
from rematlab.study.modelfile import check_archive, check_state, translated

_log = logging.getLogger("rematlab")
# The types beyond skops' defaults that a fitted predictor holds: our estimators and the tree
# structures of the boosting and random-forest models. An exact list, never a prefix: a
# prefix such as "numpy." admits functions that run code when a crafted file names them.
SAVED_TYPES = frozenset({
    *(f"rematlab.study.predictor.{name}"
      for name in ("AnalyticPeak", "Corrected", "Floored", "LogTarget", "Roofline")),
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn.tree._tree.Tree",
})
# Where the saved classes lived before the package had subpackages (files of that layout load).
FORMER_MODULES = {"rematlab.predictor": __name__}


def _config_pipeline(estimator) -> Pipeline:
    pre = ColumnTransformer([("num", StandardScaler(), CONFIG_NUMERIC),
                             ("cat", OneHotEncoder(handle_unknown="ignore"), CONFIG_CATEGORICAL)])
    return Pipeline([("pre", pre), ("model", estimator)])


def _analytic_pipeline() -> Pipeline:
    pre = ColumnTransformer([("num", "passthrough", ANALYTIC),
                             ("cat", OneHotEncoder(handle_unknown="ignore"),
                              ["strategy_kind", "dtype", "optimizer"])])
    return Pipeline([("pre", pre), ("model", HistGradientBoostingRegressor(
        max_iter=150, learning_rate=0.1, min_samples_leaf=5, random_state=0))])


ROOFLINE = ["conv_flops_s", "mm_flops_s", "bytes_s", "ops"]


class AnalyticPeak(RegressorMixin, BaseEstimator):
    """Memory as the analytic model simulates it (`analytic_peak`): nothing to learn."""

    def fit(self, X: pd.DataFrame, y: np.ndarray) -> AnalyticPeak:
        self.n_features_in_ = X.shape[1]
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self)
        return X["analytic_peak"].to_numpy(float)


class Roofline(RegressorMixin, BaseEstimator):
    """time ~ a * conv FLOP-seconds + b * matmul FLOP-seconds + c * byte-seconds + d * ops + e,
    non-negative, fitted for relative error (weights 1/y²): convolutions and matrix products
    reach different fractions of a device's peak."""

    def fit(self, X: pd.DataFrame, y: np.ndarray) -> Roofline:
        pre = ColumnTransformer([("num", "passthrough", ROOFLINE)])
        self.model_ = Pipeline([("pre", pre), ("model", LinearRegression(positive=True))])
        self.model_.fit(X, y, model__sample_weight=1.0 / np.asarray(y, float) ** 2)
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self)
        return np.maximum(self.model_.predict(X), 1e-12)


class LogTarget(RegressorMixin, BaseEstimator):
    """`regressor` fitted on log(y): relative errors weigh alike across scales."""

    def __init__(self, regressor: BaseEstimator) -> None:
        self.regressor = regressor

    def fit(self, X: pd.DataFrame, y: np.ndarray) -> LogTarget:
        self.regressor_ = clone(self.regressor).fit(X, np.log(np.asarray(y, float)))
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self)
        return np.exp(self.regressor_.predict(X))


class Corrected(RegressorMixin, BaseEstimator):
    """A physical model (`base`) times a learned correction: `correction` fitted on the log
    of the base model's residual ratio."""

    def __init__(self, base: BaseEstimator, correction: BaseEstimator) -> None:
        self.base = base
        self.correction = correction

    def fit(self, X: pd.DataFrame, y: np.ndarray) -> Corrected:
        self.base_ = clone(self.base).fit(X, y)
        ratio = np.asarray(y, float) / np.maximum(self.base_.predict(X), 1e-12)
        self.correction_ = clone(self.correction).fit(X, np.log(ratio))
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self)
        return self.base_.predict(X) * np.exp(self.correction_.predict(X))


class Floored(RegressorMixin, BaseEstimator):
    """`regressor` with predictions floored at a positive epsilon (raw-target baselines can
    predict negative times, which no error in percent can score)."""

    def __init__(self, regressor: BaseEstimator) -> None:
        self.regressor = regressor

    def fit(self, X: pd.DataFrame, y: np.ndarray) -> Floored:
        self.regressor_ = clone(self.regressor).fit(X, y)
        return self

    def predict(self, X: pd.DataFrame) -> np.ndarray:
        check_is_fitted(self)
        return np.maximum(self.regressor_.predict(X), 1e-12)


def make_model(name: str) -> BaseEstimator:
    """A fresh, unfitted estimator by name (see the module docstring)."""
    if name == "sgd":
        return Floored(_config_pipeline(SGDRegressor(max_iter=5000, tol=1e-6, random_state=0)))
    if name == "rf":
        return Floored(_config_pipeline(RandomForestRegressor(n_estimators=100, n_jobs=-1,
                                                              random_state=0)))
    if name == "gbr":
        return LogTarget(_analytic_pipeline())
    if name == "analytic":
        return AnalyticPeak()
    if name == "analytic+gbr":
        return Corrected(AnalyticPeak(), _analytic_pipeline())
    if name == "roofline":
        return Roofline()
    if name == "roofline+gbr":
        return Corrected(Roofline(), _analytic_pipeline())
    raise ConfigError(f"unknown predictor model {name!r}; choose one of "
                      f"{sorted({*MODELS['time'], *MODELS['memory']})}")


RANDOM = "random 80/20"  # the study's protocol: the one the predictor chooses its models by
MODELS = {"time": ["sgd", "rf", "gbr", "roofline", "roofline+gbr"],
          "memory": ["sgd", "rf", "gbr", "analytic", "analytic+gbr"]}
CANDIDATES = {"time": ["gbr", "roofline", "roofline+gbr"],
              "memory": ["analytic", "analytic+gbr"]}


def _metrics(y: np.ndarray, p: np.ndarray) -> dict:
    ape = np.abs(p - y) / np.abs(y)
    return {"r2": float(r2_score(y, p)) if len(y) > 1 else math.nan,
            "mape": float(mean_absolute_percentage_error(y, p)),
            "p90_ape": float(np.percentile(ape, 90)), "n": len(y)}


def _cv(data: pd.DataFrame, protocol: str, seed: int = 0):
    """scikit-learn splitter and groups of a protocol: the study's random 80/20, repeated over
    5 disjoint folds, or leaving one architecture / batch size / device out."""
    if protocol == RANDOM:
        return KFold(n_splits=5, shuffle=True, random_state=seed), None
    column = {"leave one architecture out": "model", "leave one batch size out": "batch",
              "leave one device out": "device_key"}[protocol]
    return LeaveOneGroupOut(), data[column].to_numpy()


def evaluate(data: pd.DataFrame, seed: int = 0,
             oof: dict[tuple[str, str], np.ndarray] | None = None) -> pd.DataFrame:
    """One table, every model in rows, per protocol and target: R², MAPE, P90 APE, from
    out-of-fold predictions (`cross_val_predict`). `oof`, when given, receives the random
    protocol's out-of-fold predictions per (target, model): `Predictor.fit` chooses from
    them instead of cross-validating the same folds again."""
    protocols = [RANDOM, "leave one architecture out", "leave one batch size out"]
    if data["device_key"].nunique() > 1:
        protocols.append("leave one device out")
    rows = []
    for target, names in MODELS.items():
        y = data[target].to_numpy(float)
        for name in names:
            for protocol in protocols:
                cv, groups = _cv(data, protocol, seed)
                if groups is not None and len(np.unique(groups)) < 2:
                    continue
                pred = cross_val_predict(make_model(name), data, y, cv=cv, groups=groups)
                if oof is not None and protocol == RANDOM and seed == 0:
                    oof[(target, name)] = pred
                label = name + (" (study baseline)" if name in ("sgd", "rf") else "")
                rows.append({"target": target, "model": label, "protocol": protocol,
                             **_metrics(y, pred)})
    return pd.DataFrame(rows)


@dataclass
class Predictor:
    """The best model per target plus a 90% interval from out-of-fold residuals
    (split-conformal style). Constructor stores settings; `fit` learns; `predict` checks."""

    coverage: float = 0.90
    names_: dict = field(default_factory=dict)
    fitted_: dict = field(default_factory=dict)
    half_width_: dict = field(default_factory=dict)
    oof_: dict = field(default_factory=dict)  # out-of-fold predictions of the chosen models

    def fit(self, data: pd.DataFrame,
            oof: dict[tuple[str, str], np.ndarray] | None = None) -> Predictor:
        """Per target, pick the candidate with the lowest out-of-fold MAPE (the random
        protocol's folds; `oof` holds them when `evaluate` has computed them already), then
        refit it on all data; the interval half-width is the `coverage` quantile of its
        out-of-fold absolute log error."""
        if len(data) < MIN_FIT:
            raise ConfigError(f"need at least {MIN_FIT} ok configurations to fit, got "
                              f"{len(data)}")
        folds, _ = _cv(data, RANDOM)
        oof = oof or {}
        for target, names in CANDIDATES.items():
            y = data[target].to_numpy(float)
            best = None
            for name in names:
                pred = oof.get((target, name))
                if pred is None:
                    pred = cross_val_predict(make_model(name), data, y, cv=folds)
                err = float(mean_absolute_percentage_error(y, pred))
                if best is None or err < best[1]:
                    best = (name, err, pred)
            name, _, chosen = best
            self.names_[target] = name
            self.oof_[target] = chosen
            self.half_width_[target] = float(np.quantile(np.abs(np.log(chosen / y)),
                                                         self.coverage))
            self.fitted_[target] = make_model(name).fit(data, y)
        return self

    def predict(self, X: pd.DataFrame) -> pd.DataFrame:
        if not self.fitted_:
            raise ConfigError("this predictor is not fitted: call fit() or load a saved one")
        out = {}
        for target in self.names_:
            p = self.fitted_[target].predict(X)
            w = self.half_width_[target]
            out[target] = p
            out[f"{target}_low"] = p * math.exp(-w)
            out[f"{target}_high"] = p * math.exp(w)
        return pd.DataFrame(out, index=X.index)

    def save(self, path: str | Path) -> None:
        """Write the fitted models with skops, atomically (the old file survives a kill)."""
        import skops.io as sio

        state = {"names": self.names_, "fitted": self.fitted_,
                 "half_width": self.half_width_, "coverage": self.coverage}
        write_atomic(path, lambda tmp: sio.dump(state, str(tmp)))

    @classmethod
    def load(cls, path: str | Path) -> Predictor:
        """Load a file written by `save`. Only the exact types `fit` writes are trusted
        (`SAVED_TYPES`); a file naming any other type is refused before anything in it is
        constructed, because skops calls the types a file names while loading. Its size is
        checked before and its structure after (`rematlab.study.modelfile`)."""
        import skops.io as sio

        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"predictor file {p} not found")
        check_archive(p)
        data = translated(p, FORMER_MODULES)
        try:
            untrusted = sio.get_untrusted_types(data=data)
        except Exception as exc:  # zip, JSON and schema errors of a damaged file
            raise ConfigError(f"predictor file {p} is not a rematlab predictor "
                              f"({type(exc).__name__})") from None
        unsafe = sorted(set(untrusted) - SAVED_TYPES)
        if unsafe:
            raise ConfigError(f"predictor file {p} holds types we do not load: {unsafe}")
        try:
            state = sio.loads(data, trusted=list(untrusted))
        except Exception as exc:  # a well-formed skops file of another structure
            raise ConfigError(f"predictor file {p} is not a rematlab predictor "
                              f"({type(exc).__name__})") from None
        check_state(p, state, MODELS)
        return cls(coverage=state["coverage"], names_=state["names"], fitted_=state["fitted"],
                   half_width_=state["half_width"])


def predict(predictor: Predictor | str | Path, spec: Spec, device_name: str | None = None
            ) -> dict:
    """Predicted step time (s) and peak memory (bytes) of `spec`, with a 90% interval."""
    pred = predictor if isinstance(predictor, Predictor) else Predictor.load(predictor)
    f = pd.DataFrame([features(spec, device_name=device_name)])
    row = pred.predict(f).iloc[0]
    return {"time_s": float(row["time"]), "time_s_interval": [float(row["time_low"]),
                                                               float(row["time_high"])],
            "peak_bytes": float(row["memory"]),
            "peak_bytes_interval": [float(row["memory_low"]), float(row["memory_high"])],
            "analytic_peak_bytes": float(f["analytic_peak"].iloc[0]),
            "coverage": pred.coverage, "models": dict(pred.names_)}


def fit_and_evaluate(summary: pd.DataFrame, out: str | Path | None = None,
                     untrusted: bool = False) -> tuple[Predictor, pd.DataFrame, pd.DataFrame]:
    """Features of every trusted ok configuration of a `config_summary` frame (`dataset`),
    the evaluation table, and the predictor fitted on all of them (saved to `out` when
    given): what `rematlab fit` and the study's predictor stage both do."""
    data = dataset(summary, untrusted)
    oof: dict[tuple[str, str], np.ndarray] = {}
    table = evaluate(data, oof=oof)
    predictor = Predictor().fit(data, oof)
    if out is not None:
        predictor.save(out)
    return predictor, table, data
