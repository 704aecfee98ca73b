"""A small convolutional network for 1-channel images (Fashion-MNIST 28x28, digits 8x8).

Example:
    >>> import torch
    >>> net = cnn(image_size=28, channels=16, hidden=128, classes=10)
    >>> tuple(net(torch.zeros(2, 1, 28, 28)).shape)
    (2, 10)
    >>> sum(p.numel() for p in net.parameters())
    206922
"""

from __future__ import annotations

from torch import nn

__all__ = ["cnn"]


def cnn(image_size: int = 28, channels: int = 32, hidden: int = 256, classes: int = 10,
        in_channels: int = 1) -> nn.Sequential:
    """Two (conv 3x3 -> ReLU -> max-pool 2) stages, then a hidden Linear layer.

    Args:
        image_size: height = width of the input; must be divisible by 4 (two pools).
        channels: filters of the first conv (the second has twice as many); more => more
            compute per parameter.
        hidden: width of the fully connected layer; most parameters live here.
        classes: outputs.
        in_channels: input channels (1 for grey images).
    """
    if image_size < 4 or image_size % 4:
        raise ValueError(f"image_size must be a multiple of 4 (two 2x2 pools), got {image_size}")
    if min(channels, hidden, classes, in_channels) < 1:
        raise ValueError("channels, hidden, classes and in_channels must be >= 1")
    side = image_size // 4
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),  # (N, 2 * channels * side * side)
        nn.Linear(2 * channels * side * side, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )
