"""Elastic training: restart under torchrun, exact checkpoints, and live mode.

- :mod:`hexagram.rendezvous`: a store prefix per torchrun restart attempt and a
  deadline on process-group set-up (used by :func:`hexagram.init`).
- :mod:`hexagram.elastic.checkpoint`: :func:`save_checkpoint` / :func:`load_checkpoint` on
  ``torch.distributed.checkpoint`` with every rank's algorithm state.
- :mod:`hexagram.elastic.trainer` (:func:`live`), :mod:`hexagram.elastic.quorum` and
  :mod:`hexagram.elastic.liveness` (heartbeats, the step watcher): live
  mode, in which survivors keep training when a rank dies and a restarted rank rejoins;
  :mod:`hexagram.elastic.residuals`: error-feedback residuals at a membership change;
  :mod:`hexagram.elastic.service`: live mode across machines (``hexagram elastic-store``
  hosts the job's store, ``hexagram elastic-run`` starts and restarts one replica).

See docs/elastic.md.
"""

from hexagram.elastic.quorum import QuorumError
from hexagram.elastic.trainer import LiveTrainer, live

__all__ = ["LiveTrainer", "QuorumError", "live"]
