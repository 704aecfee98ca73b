"""SparseLoCo and 4-bit DiLoCo train digits to within 2 points of allreduce with the user's
``SGD(lr=0.05, momentum=0.9)`` as the inner optimizer (DeMo, a gradient algorithm, is in
``test_algo_dropin``'s run of every gradient algorithm).

The setting of ``test_algo_dropin``: an MLP on scikit-learn digits, 4 ranks, 8 epochs (80
steps per rank), evaluated on the shared weights (period 10: the last step syncs). The
model has 4.9K parameters, so SparseLoCo runs at density 0.25 (the paper's 1.56 % keeps
one value per 64 and reached 76.8 %; 0.1: 89.8 %; 0.25: 91.3 %; 0.5: 91.1 %; allreduce
91.5 %, one run each on a 2-core machine).
"""

from __future__ import annotations

import pytest
from _compressed_training import Spec, train_specs  # tests/ is on sys.path under pytest

from hexagram.launch import run_local

SPECS = [Spec("allreduce", lr=0.05, momentum=0.9),
         Spec("sparseloco", {"period": 10, "density": 0.25}, lr=0.05, momentum=0.9),
         Spec("diloco", {"period": 10, "compressor": "minmax4"}, lr=0.05, momentum=0.9,
              label="diloco+minmax4")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_within_two_points_of_allreduce() -> None:
    per_rank = run_local(train_specs, 4, args=(SPECS, 8, 32), timeout=280)
    for r in per_rank[1:]:  # the weight algorithms end on the shared weights
        assert {k: v["digest"] for k, v in r.items()} == \
            {k: v["digest"] for k, v in per_rank[0].items()}
    acc = {k: v["acc"] for k, v in per_rank[0].items()}
    assert acc["allreduce"] > 85.0, acc
    for label, value in acc.items():
        assert value >= acc["allreduce"] - 2.0, f"{label}: {value:.2f}% vs {acc}"
    sent = {k: v["bytes_per_step"] for k, v in per_rank[0].items()}
    # per step: 627 and 421 bytes against allreduce's 28860 (digits is too small for the
    # paper's density; at the LM scale see docs/benchmarks/loco.md)
    assert max(sent["sparseloco"], sent["diloco+minmax4"]) < sent["allreduce"] / 40, sent
