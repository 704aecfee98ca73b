"""A rank that sends malformed payloads stops every rank at the same step, named.

Two ranks train through the real algorithm path (``topk``: allgathered (index, value)
pairs with error feedback; ``qsgd``: scatter-gather of per-chunk norms and codes;
``gtopk``: (value, index) messages merged on the way (every index repeated), one tensor
per bucket; ``sparseloco``: allgathered chunked top-k (bin means NaN);
``low_precision_decentralized``: payloads to ring neighbours only, the fault carried by the
round's control collective). From step ``BAD_STEP`` on, the bytes rank 1 puts on the wire
are those of a corrupted payload: every index past the end (top-k), a NaN norm or every
byte random (QSGD). Both ranks must raise the same
:class:`~hexagram.errors.NonFiniteGradientError` (or its ``MalformedPayloadError``) at that
step, naming rank 1 and the same tensor, with no raw torch error and no hang (the run has
a deadline); gTop-k agrees on the fault once a step, not once per bucket, and under
``on_nonfinite="skip"`` skips those steps on both ranks.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from _malformed import BAD_STEP, STEPS, Run, corrupt_buffers, train, wrap

from hexagram.launch import run_local


def _corrupt(payload: Any, how: str) -> Any:
    tensors = list(payload.tensors)
    if how == "malformed":  # the byte attack: every tensor's bytes random
        from hexagram.testing.byte_attacks import corrupt_payload

        return corrupt_payload("malformed", payload, RANDOM)
    if how == "nan":  # every floating tensor (scales, bin means) NaN
        tensors = [t.new_full(t.shape, float("nan")) if t.is_floating_point() else t
                   for t in tensors]
    elif how == "index":  # (values, indices): every index past the end of the tensor
        tensors[-1] = torch.full_like(tensors[-1], 10**6)
    else:  # (norms, codes): one chunk's norm NaN
        norms = tensors[0].clone()
        norms[0] = float("nan")
        tensors[0] = norms
    return replace(payload, tensors=tuple(tensors))


RANDOM = torch.Generator().manual_seed(1)  # the malformed bytes, the same every run


def _sabotage(how: str, armed: list[bool]) -> None:
    """Rank 1's bytes on the wire: every payload it packs for a collective is corrupted
    once ``armed[0]`` holds (its own error-feedback residuals see the honest payload, as
    with bytes corrupted in transit)."""
    if how == "pairs":  # gTop-k's (value, index) messages: every index the same
        from hexagram.comm import gtopk_tree

        pack = gtopk_tree._pack

        def bad_pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
            return pack(values, torch.zeros_like(indices) if armed[0] else indices)

        gtopk_tree._pack = bad_pack
        return
    corrupt_buffers(lambda payload: _corrupt(payload, how), armed)


#: gTop-k runs with one tensor per bucket (four exchanges a step, one fault agreement)
BUCKET_MB = {"gtopk": 0.0}


def _worker(algorithm: str, how: str, options: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    config = {"sparseloco": {"period": 1}, "gtopk": {"density": 0.1}}.get(algorithm, {})
    run = wrap(algorithm, {**config, **(options or {})},
               bucket_size_mb=BUCKET_MB.get(algorithm, 25.0))
    armed = [False]
    if run.rank == 1:
        _sabotage(how, armed)
    # gTop-k: buckets, bytes of its fault agreements and steps skipped so far, per step
    seen: list[tuple[int, int, int]] = []
    outcome = train(run, armed, after_step=lambda _: seen.append(_faults(run)))
    params = [p.detach().reshape(-1).tolist() for p in run.net.parameters()]
    return {**outcome, "faults": seen, "params": params}


def _faults(run: Run) -> tuple[int, int, int]:
    by_op = run.model.algorithm.ctx.comm.counter.by_op()
    skipped = getattr(run.model.algorithm, "skipped_steps", 0)
    return len(run.model.buckets), by_op.get("gtopk.fault", 0), skipped


#: a weight algorithm's rounds raise at the control collective after the one that received
#: the payload (sparseloco: the next round, a step later)
LATE = {"sparseloco": 1}


@pytest.mark.parametrize(("algorithm", "how"), [
    ("topk", "index"), ("qsgd", "norm"), ("qsgd", "malformed"), ("gtopk", "pairs"),
    ("sparseloco", "nan"), ("low_precision_decentralized", "nan")])
def test_both_ranks_raise_the_same_named_error_naming_rank_1(algorithm: str,
                                                             how: str) -> None:
    outcomes = run_local(_worker, 2, args=(algorithm, how), timeout=180)
    for out in outcomes:
        assert out["error"] is not None, f"rank {out['rank']} trained on: {out}"
        kind, message = out["error"]
        # the engine reads the step's checks (NonFiniteGradientError), or the algorithm
        # does at the end of backward (its MalformedPayloadError subclass)
        assert kind in ("MalformedPayloadError", "NonFiniteGradientError"), out
        assert message.startswith("malformed payload") and "rank 1 sent" in message, out
        assert out["step"] == BAD_STEP + LATE.get(algorithm, 0), out
    assert outcomes[0]["error"] == outcomes[1]["error"]
    if algorithm == "gtopk":  # several buckets, ONE 8-byte fault agreement per step
        for out in outcomes:
            assert [f[0] for f in out["faults"]] == [4] * BAD_STEP, out
            assert [f[1] for f in out["faults"]] == [8, 16], out  # 8 bytes a step


def test_gtopk_under_skip_skips_the_same_steps_on_every_rank() -> None:
    outcomes = run_local(_worker, 2, args=("gtopk", "pairs", {"on_nonfinite": "skip"}),
                         timeout=180)
    for out in outcomes:
        assert out["error"] is None and out["finite"], out
        # four buckets, one agreement a step; from BAD_STEP on every step is skipped
        assert out["faults"] == [(4, 8 * (step + 1), max(0, step + 1 - BAD_STEP))
                                 for step in range(STEPS)], out
    assert outcomes[0]["params"] == outcomes[1]["params"]
