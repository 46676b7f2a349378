"""Costs without data: fake twins of models and batches, the op log a target's roofline
prices, device profiles and calibrations, the CUDA caching allocator's rounding."""
