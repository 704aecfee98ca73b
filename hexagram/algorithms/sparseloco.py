"""SparseLoCo (Sarfi, Therien, Lidin, Belilovsky 2025, arXiv 2508.15706): DiLoCo whose
pseudo-gradient is sent as a chunked top-k with 2-bit values, error feedback in place of
the outer momentum.

Every rank runs the wrapped (inner) optimizer for ``period`` steps from the shared weights
``anchor``; then, with ``e_i`` its error-feedback buffer (the paper's Algorithm 1)::

    delta_i = anchor - x_i                      # pseudo-gradient
    e_i     = error_decay * e_i + delta_i       # beta, 0.95 in the paper
    s_i     = Q(TopK_chunk(e_i))                # k per chunk of `chunk`, `bits`-bit values
    e_i     = e_i - s_i                         # what was not sent stays local
    anchor  = anchor - outer_lr * sum_i s_i / n # alpha = 1 in the paper
    x_i     = anchor

``Q(TopK_chunk(.))`` is :class:`~hexagram.compress.chunk_topk.ChunkTopKCompressor` (its
module doc gives the wire format: per-chunk scale, sign-magnitude value codes, positions in
``bit_length(chunk - 1)`` bits); payloads are allgathered and every rank decodes them in
rank order, so the shared weights stay bit-identical. The paper's defaults: chunks of 4096
(it tiles matrices in 64 x 64 blocks; here chunks are contiguous runs of the flat tensor),
k = 64 per chunk (density 1.56 %), 2 bits, ``beta = 0.95``, ``alpha = 1``.

The schedule, fragments (streaming), overlap, the join protocol of uneven ends,
``synchronize()`` and checkpoints are DiLoCo's (this class is a
:class:`~hexagram.algorithms.diloco.DiLoCoAlgorithm` without outer momentum); only the
exchange differs. The error buffers are saved under ``state["feedback"]["residuals"]``, so
live elastic mode re-centres them with its named residual policy
(:mod:`hexagram.elastic.residuals`) as it does PowerSGD's.

Example:
    >>> SparseLoCoConfig(period=30, density=0.02).error_decay
    0.95
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hexagram.algorithms.base import AlgorithmContext
from hexagram.algorithms.diloco import DiLoCoAlgorithm, DiLoCoConfig, _InFlight, _Local, any_flag
from hexagram.algorithms.flat_weights import FlatWeights, Named, by_dtype_and_device, named_copies
from hexagram.comm import primitives
from hexagram.comm.communicator import Handle
from hexagram.compress.base import Payload
from hexagram.compress.chunk_topk import ChunkTopKCompressor, ChunkTopKConfig
from hexagram.compress.chunk_topk_flat import ChunkTopKRows, Sparse
from hexagram.compress.faults import any_of
from hexagram.config import check_float, check_int

__all__ = ["SparseLoCoAlgorithm", "SparseLoCoConfig"]


@dataclass(frozen=True, kw_only=True)
class SparseLoCoConfig:
    """Config of :class:`SparseLoCoAlgorithm`.

    Attributes:
        period: inner steps between synchronisations of a fragment (H); larger => less
            traffic, more drift.
        density: fraction of each chunk sent; smaller => fewer bytes, more left in the
            error buffer.
        bits: bits per sent value (1 to 8); fewer => fewer bytes, coarser values.
        chunk: elements per top-k chunk (at most 65536); larger => fewer scales, one more
            position bit per doubling.
        error_decay: beta, decay of the error buffer in [0, 1]; larger => more memory of
            what was not sent (it plays the outer momentum's part).
        outer_lr: alpha, step of the shared weights along the averaged sparse update.
        fragments, overlap_steps, overlap_mix: streaming, as in
            :class:`~hexagram.algorithms.diloco.DiLoCoConfig`.
    """

    period: int = 50
    density: float = 64 / 4096
    bits: int = 2
    chunk: int = 4096
    error_decay: float = 0.95
    outer_lr: float = 1.0
    fragments: int = 1
    overlap_steps: int = 0
    overlap_mix: float = 0.5

    def __post_init__(self) -> None:
        check_float(self, "error_decay", low=0.0, high=1.0)
        check_int(self, "period", low=1)
        self.compressor_config()  # checks density, bits, chunk
        self.outer()  # checks the schedule

    def compressor_config(self) -> ChunkTopKConfig:
        return ChunkTopKConfig(chunk=self.chunk, density=self.density, bits=self.bits)

    def outer(self) -> DiLoCoConfig:
        """The DiLoCo config of the schedule and outer step (no outer momentum)."""
        return DiLoCoConfig(period=self.period, outer_lr=self.outer_lr, outer_momentum=0.0,
                            compressor=ChunkTopKCompressor(self.compressor_config()),
                            fragments=self.fragments, overlap_steps=self.overlap_steps,
                            overlap_mix=self.overlap_mix)


class _Chunked(FlatWeights):
    """A fragment's tensors of one dtype/device laid out in whole chunks (``coder``'s
    :class:`~hexagram.compress.chunk_rows.ChunkRows`): the buffers SparseLoCo encodes."""

    def __init__(self, named: Named, config: ChunkTopKConfig) -> None:
        self.coder = ChunkTopKRows(config, [p.numel() for _, p in named], named[0][1].dtype)
        super().__init__(named, self.coder.layout.offsets, self.coder.layout.numel)


class SparseLoCoAlgorithm(DiLoCoAlgorithm):
    """DiLoCo with chunked top-k, quantized pseudo-gradients and error feedback.

    Per outer step and flat buffer (every tensor of one dtype and device, padded to whole
    chunks): one read of the weights, the error update over the buffer, one top-k and one
    quantizer per row format (:class:`~hexagram.compress.chunk_topk_flat.ChunkTopKRows`),
    ONE payload allgathered, decoded once per rank into the sum (this rank's own from what
    it encoded), and the NaN/Inf flag of the encode joined to the round's control read. A
    peer's malformed payload (positions past their chunk or repeated, bin means NaN/Inf)
    adds nothing, and its flag rides in the next round's control: every rank raises
    :class:`~hexagram.errors.MalformedPayloadError` there, naming the sender.
    """

    name = "sparseloco"
    exact_local = True
    checks_received = True

    def __init__(self, config: SparseLoCoConfig | None = None) -> None:
        cfg = config or SparseLoCoConfig()
        super().__init__(cfg.outer())
        self.config = cfg

    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self.errors = [[w.new() for w in f] for f in self.fragments]

    def _lay_out(self, named: Named) -> list[FlatWeights]:
        return [_Chunked(g, self.config.compressor_config()) for g in by_dtype_and_device(named)]

    def _prepare(self, f: int) -> _Local:
        """``e = beta e + (anchor - x)``; encode ``e``; ``e -= s_i`` (what was sent)."""
        beta, updates, flags = self.config.error_decay, [], []
        for w, a, x, e in zip(self.fragments[f], self.anchor[f], self._scratch[f],
                              self.errors[f]):
            assert isinstance(w, _Chunked)
            w.read(x)
            e.flat.mul_(beta).add_(torch.sub(a.flat, x.flat, out=x.flat))
            payload, sent, nonfinite = w.coder.encode(e.flat)
            w.coder.add_into(e.flat, sent, sign=-1.0)  # the rest stays local
            updates.append((payload, sent))
            flags.append(nonfinite)
        return _Local(updates, any_flag(flags))

    def _start(self, f: int, n: int, local: _Local | None) -> _InFlight:
        """Start the sum over ranks of the fragment's sparse, quantized updates ``s_i``
        (a payload of zeros where this rank has nothing new since the last sync)."""
        self.fresh[f] = False
        sums = []
        for i, w in enumerate(self.fragments[f]):
            assert isinstance(w, _Chunked)
            if local is not None:
                payload, sent = local.updates[i]
            else:
                payload, sent, _ = w.coder.encode(torch.zeros_like(self.anchor[f][i].flat))
            sums.append(self._exchange(w, payload, sent))
        return _InFlight(f, self.step, self.step + self.outer.overlap_steps, n, sums)

    def _exchange(self, w: _Chunked, payload: Payload, sent: Sparse) -> Handle[torch.Tensor]:
        """Allgather ``payload``; the handle's result is the sum of every rank's decoded
        update in rank order (a new buffer of ``w``'s layout, zero padding)."""
        comm = self.ctx.comm

        def decode(gathered: list[list[Payload]]) -> torch.Tensor:
            out = torch.zeros(w.numel, dtype=w.dtype, device=w.device)
            for r, p in enumerate(gathered[0]):
                w.coder.add_into(out, sent if r == comm.rank else self._checked(p, w, r))
            return out

        return primitives.allgather_payloads_many(comm, [payload]).then(decode)

    def _checked(self, payload: Payload, w: _Chunked, sender: int) -> Sparse:
        """``sender``'s payload decoded (safe on any bytes), its values zero where it is
        malformed; the flag joins the next round's control collective, which raises on
        every rank (every rank decodes the same gathered bytes)."""
        faults: list[torch.Tensor] = []
        sparse = w.coder.decode(payload, faults)
        bad = any_of(faults)
        self._received(bad, sender)
        sparse.values = [torch.where(bad, torch.zeros_like(v), v) for v in sparse.values]
        return sparse

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        residuals: dict[str, torch.Tensor] = {}
        for f, weights in enumerate(self.fragments):
            residuals.update(named_copies(weights, self.errors[f]))
        state["feedback"] = {"residuals": residuals}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        named = state["feedback"]["residuals"]
        self.errors = [[w.load(named, "sparseloco error feedback") for w in f]
                       for f in self.fragments]
