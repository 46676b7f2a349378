"""Thin bridges to the trainers users run, one module per library, each importing its library
lazily: they read the trainer's settings into a `rematlab.Step` and call the public API."""
