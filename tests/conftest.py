"""Shared test set-up: hypothesis profiles, seeding, one thread."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Two cores run the suite; intra-op threads only add overhead on the tiny tensors used here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield
