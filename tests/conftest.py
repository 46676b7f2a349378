"""Shared fixtures: small, deterministic, CPU-only."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    torch.set_num_threads(2)
    yield
