"""Elastic training: restart under torchrun and exact, collective checkpoints.

- :mod:`hexagram.elastic.rendezvous`: a store prefix per torchrun restart attempt and a
  deadline on process-group set-up (used by :func:`hexagram.init`).
- :mod:`hexagram.elastic.checkpoint`: :func:`save_checkpoint` / :func:`load_checkpoint` on
  ``torch.distributed.checkpoint`` with every rank's algorithm state.

See docs/elastic.md.
"""
