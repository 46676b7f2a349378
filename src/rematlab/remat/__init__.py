"""Rematerialization at run time: finding a model's blocks or layers, recompute contexts,
and running a plan on a chain or inside a model's own layer loop."""
