"""The bottom layer: the user's training step and batches, memory and time probes, the
interference guard, units and safe file writes. Imports nothing else from rematlab."""
