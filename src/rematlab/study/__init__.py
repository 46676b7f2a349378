"""The study: grids, sweeps (local or Ray) into the store, statistics, predictors and
the report."""
