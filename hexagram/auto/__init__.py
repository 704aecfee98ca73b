"""``algorithm="auto"``: profile the job, price every candidate, time the near-ties, delegate.

It stands above :mod:`hexagram.algorithms` (the candidates) and :mod:`hexagram.cost` (the
step-time model that prices them):

- :mod:`hexagram.auto.choose`: candidate sets, prediction of every candidate, near-tie
  trials, the reason and the table;
- :mod:`hexagram.auto.config`: :class:`~hexagram.auto.config.AutoConfig`;
- :mod:`hexagram.auto.algorithm`: the algorithm the registry returns for ``"auto"``;
- :mod:`hexagram.auto.trials`, :mod:`hexagram.auto.tune`: timed trials and bucket tuning;
- :mod:`hexagram.auto.simulate`: ``simulate`` by label (the registry's algorithms priced by
  :mod:`hexagram.cost.simulate`).

Example:
    >>> import hexagram as hx
    >>> hx.algorithms.get("auto", candidates=["allreduce", "fp16"]).config.candidates
    ('allreduce', 'fp16')
"""
