"""The soak (tests/soak.py) at a reduced size: 100 steps of the demo's GPT over 2 gloo ranks with
a new batch shape almost every step; no memory growth, no drift from the reference. The full
300-step run: ``.venv/bin/python -m tests.soak --steps 300``."""

from __future__ import annotations

from typing import Any

import pytest

from tests import soak


@pytest.mark.timeout(240)
def test_soak_keeps_memory_flat_and_matches_the_reference(pool: Any) -> None:
    results = pool(2).run(soak.soak_rank, 100, 25)
    for res in results:
        print(res)  # shown with pytest -s: RSS after warm-up and at the end, drift, seconds
        assert res["checks"] == 5 and res["distinct_shapes"] > 30
        assert res["max_loss_drift"] < 1e-10 and res["max_grad_drift"] < 1e-10, res
        assert res["rss_growth_mb"] < 50, res
        assert not res["trimmed_growth_mb"] >= 20, res  # live memory (nan without glibc)
    assert results[0]["final_loss"] == results[1]["final_loss"]
