"""Byzantine-robust aggregation: pure aggregators (:mod:`.aggregators`) and the shard-wise
reduction the ``robust`` algorithm runs on them (:mod:`.shard_reduce`); see docs/robust.md."""
