"""The aten ops a wrapper adds to a training step: for every algorithm at most torch DDP's
count + 400, on a model of 128 parameter tensors.

Each op costs host time in the dispatcher, and on a GPU each op that computes is a kernel
launch (about 8 us of host time), so a wrapper whose per-step work grows with the number of
parameter tensors loses to torch DDP on any fast link, however well it compresses.
``benchmarks/step_ops.py`` does the counting (its module doc gives the set-up and the
counting rule: ops as dispatched, a composite op as what it decomposes into, never the ops
inside another op's kernel, the same for every setup; thread-pool jobs of the counted
steps included). All setups run in one world-1 process, once per module;
``pytest -s`` prints the table, and a failure shows it.

Nested ops are not counted on purpose: on the CPU a ``torch._foreach_*`` op runs one op
per tensor inside its kernel, where CUDA launches a few fused kernels; counting the inner
ops would charge the fix (flat buffers, ``_foreach_*``) as per-tensor work.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import pytest
import step_ops  # benchmarks/ (tests/conftest.py puts it on the path)
import torch

import hexagram as hx
from hexagram.launch import run_local

MARGIN = 400  # ops over two steps a wrapper may add beyond torch DDP's
NAMES = hx.algorithms.names()


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = run_local(step_ops.count_all, 1, timeout=240)[0]
    print("\n" + step_ops.format_table(table))
    return table


def test_torch_ddp_is_counted_per_parameter_tensor(rows: dict[str, dict[str, Any]]) -> None:
    # torch DDP's reducer copies each gradient into its bucket and back, from C++ hooks
    # in backward: the count sees ops dispatched there, per tensor, per step
    ddp = rows[step_ops.DDP]
    assert "error" not in ddp, ddp
    assert ddp["added"] >= step_ops.COUNTED * 2 * step_ops.LAYERS, step_ops.format_table(rows)
    assert ddp["buckets"] == 1


@pytest.mark.parametrize("name", NAMES)
def test_algorithm_adds_at_most_torch_ddps_ops_plus_400(
        name: str, rows: dict[str, dict[str, Any]]) -> None:
    row, ddp = rows[name], rows[step_ops.DDP]
    table = step_ops.format_table(rows)
    assert "error" not in row, f"{name} failed: {row.get('error')}\n{table}"
    assert row["buckets"] <= 1, f"{name}: {row['buckets']} buckets, the count wants one"
    assert row["added"] <= ddp["added"] + MARGIN, (
        f"{name} adds {row['added']:,} ops to {step_ops.COUNTED} steps of a model of "
        f"{2 * step_ops.LAYERS} parameter tensors; torch DDP adds {ddp['added']:,} "
        f"(allowed: {ddp['added'] + MARGIN:,}). Most added: {row['top']}\n{table}")


def test_counter_counts_ops_as_dispatched_and_not_inside_kernels() -> None:
    x = torch.ones(4)
    with step_ops.OpCounter().counting() as counter:
        x.to(torch.float16)  # aten::to decomposes to one _to_copy (its copy_ is inside)
        torch._foreach_add([x, x, x], 1.0)  # one op, whatever its CPU kernel loops over
    assert dict(counter.ops) == {"aten._to_copy": 1, "aten._foreach_add": 1}


def test_counter_counts_thread_pool_jobs_of_the_counted_steps() -> None:
    x = torch.ones(4)
    with cf.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: x + 1).result()  # the pool's thread exists before counting
        with step_ops.OpCounter().counting() as counter:
            pool.submit(lambda: x * 2).result()
            x - 1
        pool.submit(lambda: x + 3).result()  # after counting: not counted
    assert dict(counter.ops) == {"aten.mul": 1, "aten.sub": 1}
