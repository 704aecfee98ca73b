"""Image classification data that ships offline: Fashion-MNIST and scikit-learn's digits.

Fashion-MNIST comes from the Debian package ``dataset-fashion-mnist`` (idx files under
``/usr/share/datasets/fashion-mnist``; ``make setup`` installs it, or set
``HEXAGRAM_FASHION_MNIST`` to another folder). scikit-learn's bundled 8x8 digits are the
embedded fallback.

Example:
    >>> ds = load("digits")
    >>> ds.x_train.shape[1:], ds.classes
    (torch.Size([1, 8, 8]), 10)
"""

from __future__ import annotations

import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from hexagram.errors import require

__all__ = ["FASHION_MNIST_DIR", "Dataset", "load", "shard"]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


@dataclass(frozen=True)
class Dataset:
    """Tensors of a split dataset; images are float32 in [0, 1], shape (N, 1, H, W)."""

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    classes: int


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _find(folder: Path, stem: str) -> Path:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem} not found in {folder}: install the Debian package "
        "(`apt-get install dataset-fashion-mnist`, done by `make setup`), set "
        "HEXAGRAM_FASHION_MNIST to a folder holding the idx files, or use dataset='digits'")


def _fashion_mnist() -> Dataset:
    folder = Path(os.environ.get("HEXAGRAM_FASHION_MNIST", FASHION_MNIST_DIR))
    arrays = {stem: _read_idx(_find(folder, stem)) for stem in (
        "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}

    def images(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a.astype(np.float32) / 255.0).unsqueeze(1)

    return Dataset("fashion-mnist", images(arrays["train-images-idx3-ubyte"]),
                   torch.from_numpy(arrays["train-labels-idx1-ubyte"].astype(np.int64)),
                   images(arrays["t10k-images-idx3-ubyte"]),
                   torch.from_numpy(arrays["t10k-labels-idx1-ubyte"].astype(np.int64)), 10)


def _digits(test_fraction: float = 0.25) -> Dataset:
    datasets = require("sklearn.datasets", extra="data",
                       feature="the digits dataset (used when Fashion-MNIST is not installed)")
    bunch = datasets.load_digits()
    x = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test], 10)


def fashion_mnist_available() -> bool:
    """True when the Fashion-MNIST idx files can be found."""
    try:
        _find(Path(os.environ.get("HEXAGRAM_FASHION_MNIST", FASHION_MNIST_DIR)),
              "t10k-labels-idx1-ubyte")
        return True
    except FileNotFoundError:
        return False


def load(name: str = "fashion-mnist") -> Dataset:
    """Load ``"fashion-mnist"`` or ``"digits"`` (``"auto"``: the first available)."""
    if name == "auto":
        name = "fashion-mnist" if fashion_mnist_available() else "digits"
    if name == "fashion-mnist":
        return _fashion_mnist()
    if name == "digits":
        return _digits()
    raise ValueError(f"unknown dataset {name!r}; valid: 'fashion-mnist', 'digits', 'auto'")


def shard(x: Tensor, y: Tensor, rank: int, world_size: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s interleaved share of (x, y), as DistributedSampler without shuffle."""
    return x[rank::world_size], y[rank::world_size]
