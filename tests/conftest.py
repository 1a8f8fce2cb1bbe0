"""Shared test set-up: hypothesis profiles, seeding, one thread."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

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


# ------------------------------------------------------------------------------ process pools
# Starting gloo processes costs seconds on two cores, so each pool size is started once per test
# session and reused. Jobs are module-level functions in tests/jobs_*.py (importable in the
# workers because the repository root is put on their path). A job that fails stops its pool;
# the next request for that size starts a fresh one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_POOLS: dict[int, Any] = {}


def get_pool(size: int) -> Any:
    from funcpipe.launcher import Pool

    pool = _POOLS.get(size)
    if pool is None or pool.closed:
        # short on purpose: a hung job fails the test within two minutes (the job's deadline),
        # and a wait in gloo or a socket gives up as soon (the process group's timeout)
        pool = _POOLS[size] = Pool(size, timeout=120, pg_timeout=120, paths=[ROOT])
    return pool


@pytest.fixture(scope="session")
def pool() -> Iterator[Callable[[int], Any]]:
    """``pool(n)``: a started group of ``n`` gloo processes (``.run(fn, *args)``)."""
    yield get_pool
    for p in _POOLS.values():
        p.close()
