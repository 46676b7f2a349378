"""Backpropagation with checkpointing against forward gradients and zeroth-order
estimates: estimators, tasks, adapters and the comparison."""
