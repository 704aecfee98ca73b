"""What a chaos soak's ledgers show (:mod:`hexagram.bench.chaos`, line format in
:mod:`hexagram.bench.chaos_replica`).

:func:`analyse` reads every incarnation's ledger and the controller's events and returns:

- ``failures``: the faults that happened, by kind (external kills and freezes from the
  controller; slow steps, kills inside a collective and kills while healing from the
  ledgers, written just before they fired);
- ``steps_lost``: committed steps undone: walking the epochs in order, each one that
  committed must start at the newest step committed before it (its first commit minus
  one); any shortfall is lost;
- ``commits_compared`` / ``commit_mismatches``: voted commits recorded by two or more
  members of one epoch, and those whose digests differ (0 expected: bit-identical
  replicas at every commit); ``setups_compared`` / ``setup_mismatches`` the same for the
  set-up of every membership (healed replicas included, residuals and outer state
  included);
- ``committed_per_s``: committed steps per second between the first commit and the last
  step's; ``longest_stall_s``: the longest time the newest committed step did not move;
- ``rejoin_rounds``: per healed replica, the voted commits (outer steps of a weight
  algorithm) of the job from its healing up to and including the first it took part in
  (1: the next one).

Example:
    >>> analyse({"0_0": ["C 1 1 1 ab 1.0", "C 2 1 1 cd 2.0", "END 2 cd 2.1"]}, [], 2,
    ...         weight=False)["steps_lost"]
    0
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

__all__ = ["analyse"]


def _parse(ledgers: dict[str, list[str]]) -> dict[str, list[list[str]]]:
    """Lines split into fields (the last is the wall clock), per incarnation key."""
    return {key: [line.split() for line in lines if line.strip()]
            for key, lines in ledgers.items()}


def _commits(rows: list[list[str]]) -> list[tuple[int, int, float, str]]:
    """(step, epoch, time, digest or "") of one incarnation's commits. A commit whose
    step ended in a membership change that healed this replica forward (a ``commit+join``
    whose set-up failed, then a later set-up healed it) is followed by an ``S`` line whose
    ``before`` is the step it committed: the ``C`` line (written after the heal, under the
    old epoch) then counts as that step, without a digest (the state it hashed is the
    healed one). Counted as written, it looked like its old epoch reached the healed step."""
    out, following = [], [r for r in rows if r[0] in ("C", "S")]
    for r, nxt in zip(following, [*following[1:], None]):
        if r[0] != "C":
            continue
        step, digest = int(r[1]), r[4] if r[3] == "1" else ""
        if nxt is not None and nxt[0] == "S" and 0 <= int(nxt[4]) < step:
            step, digest = int(nxt[4]), ""
        out.append((step, int(r[2]), float(r[-1]), digest))
    return out


def _lost(commits: list[tuple[int, int, float, str]]) -> tuple[int, list[dict[str, int]]]:
    """Steps undone: per epoch (in order) its first commit minus one against the newest
    step committed in the epochs before it."""
    by_epoch: dict[int, list[int]] = defaultdict(list)
    for step, epoch, _, _ in commits:
        by_epoch[epoch].append(step)
    frontier, lost, where = 0, 0, []
    for epoch in sorted(by_epoch):
        start = min(by_epoch[epoch]) - 1
        if start < frontier:
            lost += frontier - start
            where.append({"epoch": epoch, "started_at": start, "newest_before": frontier})
        frontier = max(frontier, max(by_epoch[epoch]))
    return lost, where


def _mismatches(groups: dict[Any, set[str]], counts: Counter[Any]) -> tuple[int, list[Any]]:
    compared = [k for k in groups if counts[k] >= 2]
    bad = [k for k in compared if len(groups[k]) > 1]
    return len(compared), bad


def _timeline(commits: list[tuple[int, int, float, str]], steps: int
              ) -> tuple[float | None, float, list[float]]:
    """(committed steps per second, longest stall, stalls over 1 s) from the commits."""
    frontier, last_t, first_t, end_t, longest, long_ones = 0, None, None, None, 0.0, []
    for step, _, t, _ in sorted(commits, key=lambda c: c[2]):
        if step <= frontier:
            continue
        if last_t is not None:
            gap = t - last_t
            longest = max(longest, gap)
            if gap > 1.0:
                long_ones.append(round(gap, 3))
        frontier, last_t = step, t
        first_t = t if first_t is None else first_t
        if step >= steps and end_t is None:
            end_t = t
    rate = None if first_t is None or end_t is None or end_t <= first_t \
        else (steps - 1) / (end_t - first_t)
    return rate, longest, long_ones


def _rejoin_rounds(lines: dict[str, list[list[str]]], voted: list[int]) -> list[int | None]:
    """Per healing (a set-up that moved a replica's step forward): how many of the job's
    voted commits it takes, from the healing on, until the healed incarnation's first
    voted commit (None: it died or the run ended first)."""
    out: list[int | None] = []
    for rows in lines.values():
        for i, row in enumerate(rows):
            if row[0] != "S" or int(row[5]) <= max(int(row[4]), 0):
                continue
            healed_at = int(row[5])
            mine = [int(r[1]) for r in rows[i + 1:] if r[0] == "C" and r[3] == "1"]
            first = next((s for s in mine if s > healed_at), None)
            out.append(None if first is None else
                       sum(1 for s in voted if healed_at < s <= first))
    return out


def _freezes(lines: dict[str, list[list[str]]], events: list[dict[str, Any]]
             ) -> dict[str, int]:
    """Per SIGSTOP: was the replica left out of a membership set up while it was frozen,
    and did that incarnation rejoin after SIGCONT (or die and get restarted)?"""
    setups = [(float(r[-1]), r[0 + 2].split(","), key) for key, rows in lines.items()
              for r in rows if r[0] == "S"]
    out = Counter[str]()
    for stop in (e for e in events if e["event"] == "sigstop"):
        r, inc = stop["replica"], stop["incarnation"]
        cont = next((e["t"] for e in events if e["event"] in ("sigcont", "exit")
                     and e["replica"] == r and e["t"] > stop["t"]), float("inf"))
        excluded = any(stop["t"] < t <= cont and str(r) not in m for t, m, _ in setups)
        rejoined = any(t > cont and key == f"{r}_{inc}" and str(r) in m
                       for t, m, key in setups)
        out["frozen"] += 1
        out["excluded_while_frozen"] += excluded
        out["rejoined_same_process"] += rejoined
    return dict(out)


def analyse(ledgers: dict[str, list[str]], events: list[dict[str, Any]], steps: int, *,
            weight: bool) -> dict[str, Any]:
    """The chaos soak's figures (see the module doc) from the ledgers
    (``{"<replica>_<incarnation>": lines}``) and the controller's events."""
    lines = _parse(ledgers)
    commits = [c for rows in lines.values() for c in _commits(rows)]
    by_commit: dict[tuple[int, int], set[str]] = defaultdict(set)
    commit_counts: Counter[tuple[int, int]] = Counter()
    for step, epoch, _, digest in commits:
        if digest:
            by_commit[(epoch, step)].add(digest)
            commit_counts[(epoch, step)] += 1
    by_setup: dict[int, set[str]] = defaultdict(set)
    setup_counts: Counter[int] = Counter()
    for rows in lines.values():
        for r in rows:
            if r[0] == "S":
                by_setup[int(r[1])].add(r[3])
                setup_counts[int(r[1])] += 1
    commits_compared, bad_commits = _mismatches(by_commit, commit_counts)
    setups_compared, bad_setups = _mismatches(by_setup, setup_counts)
    lost, where = _lost(commits)
    rate, longest, long_ones = _timeline(commits, steps)
    voted = sorted({s for s, _, _, d in commits if d})
    fired = Counter(r[1] for rows in lines.values() for r in rows if r[0] == "F")
    kinds = Counter(e["event"] for e in events)
    ends = {key: (int(r[1]), r[2]) for key, rows in lines.items() for r in rows
            if r[0] == "END"}
    rounds = _rejoin_rounds(lines, voted)
    failures = {"sigkill": kinds["sigkill"] + kinds["heal_kill"],
                "sigstop": kinds["sigstop"], "slow": fired["slow"],
                "heal_kill": fired["heal_kill"], "collective_kill": fired["collective_kill"]}
    return {
        "steps": steps, "failures": failures, "failures_total": sum(failures.values()),
        "ordered_not_fired": {"collective_kill": kinds["collective_kill"]
                              - fired["collective_kill"],
                              "heal_kill": kinds["heal_kill"] - fired["heal_kill"]},
        "gave_up": sum(1 for e in events if e["event"] == "exit" and e.get("code") == 3),
        "restarts": kinds["start"] - len({e["replica"] for e in events
                                          if e["event"] == "start"}),
        "steps_lost": lost, "lost_at": where,
        "commits_compared": commits_compared, "commit_mismatches": len(bad_commits),
        "commit_mismatch_at": [list(k) for k in bad_commits[:20]],
        "setups_compared": setups_compared, "setup_mismatches": len(bad_setups),
        "setup_mismatch_at": bad_setups[:20],
        "heals": sum(1 for rows in lines.values() for r in rows
                     if r[0] == "S" and int(r[5]) > max(int(r[4]), 0)),
        "finished": {k: v[0] for k, v in ends.items()},
        "final_identical": len({v for v in ends.values()}) == 1 if len(ends) > 1 else None,
        "errors": [" ".join(r[1:-1]) for rows in lines.values() for r in rows
                   if r[0] == "ERR"],
        "committed_per_s": rate, "longest_stall_s": longest, "stalls_over_1s": long_ones,
        "rejoin_rounds": dict(Counter(str(x) for x in rounds)),
        "freezes": _freezes(lines, events), "weight_algorithm": weight,
    }
