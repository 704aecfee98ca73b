"""``delay=1`` trains to the accuracy of the same algorithm without delay (fast version of
``benchmarks/delay_convergence.py``; the Fashion-MNIST table is docs/benchmarks/delay.md).

scikit-learn's handwritten digits (1347 train / 450 test), an MLP, 4 ranks with interleaved
shards, the same seeds and batches for both runs; each run ends with ``synchronize()``, which
applies the last pending gradient. The delayed run must stay within 1.5 points (7 of the 450
test digits) of the synchronous one:

- plain SGD (lr 0.2, 10 epochs), allreduce and top-k: one step of staleness only halves the stable
  step size of gradient descent (``lr h < 1`` instead of ``< 2`` for a curvature ``h``);
- heavy-ball momentum 0.9 (lr 0.05), allreduce: on this easy problem it holds too (measured
  -0.2 points), although on Fashion-MNIST plain staleness does not (-12.5 points: a stale
  gradient with momentum ``b`` is stable only for ``lr h < 1 - b``; docs/benchmarks/delay.md);
- so ``delay=1`` runs at the predicted weights by default: on Fashion-MNIST (2 epochs) it
  must stay within 1 point of synchronous heavy ball, where ``predict=False`` falls behind.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hexagram.launch import run_local

BATCH, WORLD, EPOCHS = 16, 4, 10
#: (algorithm, momentum, lr)
RUNS = [("allreduce", 0.0, 0.2), ("topk", 0.0, 0.2), ("allreduce", 0.9, 0.05)]


def _accuracy(name: str, delay: int, momentum: float, lr: float, dataset: str = "digits",
              epochs: int = EPOCHS, batch: int = BATCH, hidden: int = 64,
              predict: bool = True) -> float:
    import hexagram as hx
    from hexagram.data import load, shard
    from hexagram.models import mlp

    rt = hx.get_runtime()
    ds = load(dataset)
    x, y = shard(ds.x_train, ds.y_train, rt.rank, rt.world_size)
    torch.manual_seed(0)
    net = mlp(x[0].numel(), hidden, 1, ds.classes)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    options = {"predict": predict} if delay else {}
    model = hx.DistributedDataParallel(net, optimizers=[opt],
                                       algorithm=hx.algorithms.get(name, delay=delay,
                                                                     **options))
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for b in range(len(y) // batch):
            idx = order[b * batch:(b + 1) * batch]
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
    model.synchronize()
    with torch.no_grad():
        acc = (net(ds.x_test).argmax(1) == ds.y_test).float().mean().item()
    model.close()
    return 100.0 * acc


def _worker(runs: list[tuple[str, float, float]]) -> dict[str, float]:
    import hexagram as hx

    hx.init()
    return {f"{name}/m{momentum}/delay={delay}": _accuracy(name, delay, momentum, lr)
            for name, momentum, lr in runs for delay in (0, 1)}


def _fashion_worker() -> dict[str, float]:
    import hexagram as hx

    hx.init()

    def run(delay: int, predict: bool = True) -> float:
        return _accuracy("allreduce", delay, 0.9, 0.05, "fashion-mnist", epochs=2, batch=128,
                         hidden=128, predict=predict)

    return {"sync": run(0), "predicted": run(1), "stale": run(1, predict=False)}


def test_delay_within_one_and_a_half_points() -> None:
    results = run_local(_worker, WORLD, args=(RUNS,), timeout=300)
    acc = results[0]
    assert all(r == acc for r in results), "ranks evaluated different models"
    for name, momentum, _ in RUNS:
        sync, delayed = acc[f"{name}/m{momentum}/delay=0"], acc[f"{name}/m{momentum}/delay=1"]
        assert sync > 90.0, acc
        assert delayed >= sync - 1.5, f"{name}, momentum {momentum}: {acc}"


def test_weight_prediction_keeps_heavy_ball_on_fashion_mnist() -> None:
    """Where plain staleness breaks heavy ball (Fashion-MNIST, SGD lr 0.05, momentum 0.9,
    2 epochs, batch 128 per rank; measured 82.5 % synchronous, 62.2 % stale), ``delay=1``
    with its default weight prediction stays within 1 point (measured 83.3 %)."""
    from hexagram.data import fashion_mnist_available

    if not fashion_mnist_available():
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    results = run_local(_fashion_worker, WORLD, timeout=300)
    acc = results[0]
    assert all(r == acc for r in results), "ranks evaluated different models"
    assert acc["sync"] > 80.0, acc
    assert acc["predicted"] >= acc["sync"] - 1.0, acc
    # why prediction is the default: without it the stale heavy ball falls far behind
    assert acc["stale"] < acc["sync"] - 5.0, acc
