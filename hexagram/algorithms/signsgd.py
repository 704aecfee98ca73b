"""signSGD with majority vote (Bernstein et al. 2018): signs by allgather, element-wise vote.

Every rank sends one bit per element (the signs of its gradient); every rank gathers all
signs and takes the element-wise majority, ``sign(sum_i sign(g_i))`` (0 on a tie). The
update has unit magnitude per element, so use a small learning rate (about 1e-3 with SGD) or
momentum on the workers' side (signum). Robust to a minority of ranks that flip signs.

Example:
    >>> import torch
    >>> majority_vote([torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-1.0, -1.0, 0.5]),
    ...                torch.tensor([2.0, 1.0, 1.0])])
    tensor([ 1., -1.,  1.])
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from hexagram import compress
from hexagram.algorithms.compressed import CompressedConfig, CompressorAlgorithm

__all__ = ["SignSGDAlgorithm", "SignSGDConfig", "majority_vote"]


def majority_vote(decoded: list[Tensor]) -> Tensor:
    """Element-wise majority of the ranks' signs: ``sign(sum_i sign(x_i))``."""
    votes = decoded[0].sign()
    for x in decoded[1:]:
        votes.add_(x.sign())
    return votes.sign_()


@dataclass(frozen=True, kw_only=True)
class SignSGDConfig(CompressedConfig):
    """Config of :class:`SignSGDAlgorithm` (only :class:`CompressedConfig`'s fields).

    Signs are element-wise, so ``granularity`` changes only the number of messages.
    """

    granularity: str = "bucket"


class SignSGDAlgorithm(CompressorAlgorithm):
    """Majority-vote signSGD; see :class:`SignSGDConfig`."""

    name = "signsgd"
    reduction = "majority"  # sign of the sum of the decoded (+-1) signs

    def __init__(self, config: SignSGDConfig | None = None) -> None:
        super().__init__(config or SignSGDConfig())
        self.config: SignSGDConfig
        self.use_compressor(compress.get("sign"), feedback=False)
