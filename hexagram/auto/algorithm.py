"""``algorithm="auto"``: measure the job, predict every candidate, run the fastest.

Timeline (on every rank at the same step, so collectives match):

- wrap time: a network probe (:func:`hexagram.cost.probe.probe`, about 3 s) and each
  candidate compressor's CPU cost on this device give a *provisional* choice;
- steps ``0 .. profile_steps-1``: forward, backward (when each gradient is ready) and the
  update are recorded; then every candidate at every bucket size is predicted
  (:mod:`hexagram.cost.model`, slowest rank), rank 0's choice is broadcast and one table
  printed (candidates, predicted step, wire bytes, the choice and why);
- the best ``tune_buckets`` predicted bucket sizes that give distinct bucket layouts take
  turns, one step at a time, for ``tune_steps`` steps (after any warm-up of the chosen
  algorithm, e.g. PowerSGD's ``start_iter``); the largest size whose median is within
  ``bucket_tie`` of the lowest is kept (:mod:`hexagram.auto.tune`; near-tied
  algorithms get one block each);
- watch: after ``drift_steps`` steps off the tuned step time by more than ``drift``, the
  network is probed again and the choice redone; a switch is logged.

A switch flushes the old algorithm's error-feedback residuals into the next gradients;
other state (DGC momenta, PowerSGD factors) is dropped, as the log says; a weight algorithm
synchronizes the replicas first. ``state_dict`` holds the decision (kept on resume unless
``redecide=True``): a resume is bitwise exact from the decision on, but a checkpoint saved
while auto is still :attr:`~AutoAlgorithm.exploring` (profiling, timing trials) resumes by
exploring again, and timed choices cannot be repeated bitwise. A candidate that needs
another learning rate than the user's optimizer (:func:`hexagram.auto.choose.lr_flags`) is
never chosen (listed as excluded).

Example:
    >>> import hexagram as hx
    >>> algo = hx.algorithms.get("auto", candidates=["allreduce", "powersgd"])
    >>> algo.config.candidates
    ('allreduce', 'powersgd')
"""

from __future__ import annotations

import itertools
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hexagram.algorithms.base import Algorithm, AlgorithmContext
from hexagram.auto import choose
from hexagram.auto import trials as auto_trials
from hexagram.auto import tune as auto_tune
from hexagram.auto.config import AutoConfig
from hexagram.buckets import Bucket
from hexagram.comm.communicator import Communicator, Handle
from hexagram.comm.device import group_tensor
from hexagram.compress.feedback import ErrorFeedback
from hexagram.cost import measure
from hexagram.cost.model import MB, Prediction
from hexagram.cost.probe import NetworkProfile, probe
from hexagram.cost.profile import CompressorCost, ComputeProfile
from hexagram.cost.recorder import DriftWatch, StepRecorder
from hexagram.errors import ConfigError

__all__ = ["AutoAlgorithm", "AutoConfig"]

log = logging.getLogger(__name__)


class AutoAlgorithm(Algorithm):
    """Measures, predicts and delegates every hook to the chosen algorithm (module doc)."""

    name = "auto"
    kind = "grad"

    def __init__(self, config: AutoConfig | None = None) -> None:
        super().__init__(config or AutoConfig())
        self.config: AutoConfig
        self.candidates = choose.resolve(self.config.candidates, self.config.allow_delay,
                                         self.config.lossy)
        self.delegate: Algorithm = choose.make("allreduce")
        self.label = "allreduce"
        self.decision: dict[str, Any] | None = None
        self.table = ""
        self.switches: list[dict[str, Any]] = []
        self.reprobes = 0  # network probes after the decision (drift)
        self.network: NetworkProfile | None = None
        self.compute: ComputeProfile | None = None
        self.costs: dict[str, CompressorCost] = {}
        self.flags: dict[str, str] = {}  # label -> why auto must not pick it (lr)
        self._bucket: int | None = None
        self._pending = False  # the delegate waits for the engine's rebuild to set up
        self._rebuild = False  # buckets must be rebuilt (new delegate or bucket size)
        self._advanced = -1  # the step count at which the phases last advanced
        self._mark = 0  # step count where the current phase started
        self._flush: ErrorFeedback | None = None
        self._steps = 0
        self._phase = "profile"
        self._trials: list[tuple[str, int]] = []  # (label, bucket bytes) timed after deciding
        self._predicted: dict[tuple[str, int], Prediction] = {}
        self._tuned: list[float] = []  # step times of the trial visits so far
        self._plan: list[tuple[int, int]] = []  # (trial, steps) visits (auto_tune.visits)
        self._own = (0.0, 0.0)  # auto's and the rebuild's seconds in (last, this) step
        self._own_t0 = 0.0
        self._watcher = DriftWatch(self.config.drift)
        self._recorder: StepRecorder | None = None
        self._control: Communicator | None = None
        self._retired_bytes = 0  # bytes of retired delegates' own communicators

    # -- set-up: probe, compressor costs, provisional choice ---------------------------
    def setup(self, ctx: AlgorithmContext) -> None:
        super().setup(ctx)
        self._flag_lr(ctx)
        if ctx.comm.size == 1:  # nothing to choose between, nothing to time or watch
            self._single()
        else:
            rt = ctx.runtime
            group = dist.new_group(list(range(rt.world_size)), timeout=rt.timeout)
            self._control = Communicator(group, rt.timeout, name="auto.control",
                                         owns_group=True)
            self._recorder = StepRecorder(ctx.module, ctx.named_params)
        if self.decision is None:
            assert self._recorder is not None and self._control is not None
            self._measure_network()
            static = measure.static_profile(ctx.buckets, self._recorder.specs)
            self.costs = measure.compressor_costs(self.candidates, static, ctx.comm.size,
                                                  self._control.group, ctx.runtime.device)
            self._adopt(self._decide(static, provisional=True).label, None)
        self.delegate.setup(ctx)
        self._pending = self._rebuild = False

    def _single(self) -> None:
        """One rank: allreduce (a no-op), and auto costs what it costs: no step recorder
        (no hooks on the parameters), no control group, no non-finite check (allreduce's
        ``passes_nonfinite``, which auto takes from its delegate)."""
        self.decision, self._phase = {"label": "allreduce", "reason": "one rank"}, "single"
        if self.label != "allreduce":  # a switch() before wrapping: not set up yet
            self.delegate, self.label = choose.make("allreduce"), "allreduce"
        self._follow()
        self._say("auto: one rank, nothing to communicate: allreduce (a no-op)")

    def _follow(self) -> None:
        """Declare what the delegate declares: the engine reads ``kind`` when it rebuilds
        and ``passes_nonfinite`` before every forward (it then builds or drops its
        non-finite check: allreduce needs none)."""
        vars(self)["kind"] = self.delegate.kind
        vars(self)["passes_nonfinite"] = self.delegate.passes_nonfinite
        vars(self)["drops_nonfinite"] = self.delegate.drops_nonfinite

    def _flag_lr(self, ctx: AlgorithmContext) -> None:
        """Candidates that are not drop-ins with the user's optimizers are excluded."""
        self.flags = choose.lr_flags(self.candidates, ctx.optimizers)
        if len(self.flags) == len(self.candidates):
            raise ConfigError(
                "auto: every candidate needs another learning rate than the optimizer's ("
                + ", ".join(f"{k}: {v}" for k, v in self.flags.items())
                + "); add a drop-in candidate such as 'allreduce'")
        for label, why in self.flags.items():
            self._say(f"auto: candidate {label!r} excluded: {why} (not a drop-in for the "
                      "optimizer's learning rate)")

    def _measure_network(self) -> None:
        assert self._control is not None
        rt = self.ctx.runtime
        self.network = probe(self._control, hosts=len(rt.hosts),
                             budget_s=self.config.probe_budget_s)
        for note in self.network.notes:
            self._say(f"auto: {note}")

    # -- deciding ------------------------------------------------------------------------
    def _decide(self, compute: ComputeProfile, provisional: bool = False) -> Prediction:
        """Predict every candidate; rank 0's trials (:func:`choose.trials`) are broadcast
        and the first one is the pick (:mod:`~hexagram.auto.trials`)."""
        assert self.network is not None and self._control is not None
        preds, trials = auto_trials.shortlist(self.candidates, compute, self.network,
                                              self.costs, self.flags, self.config, provisional)
        self._trials = auto_trials.agree(self._control, [lb for lb, _ in self.candidates],
                                         trials, self.config.tune_buckets)
        self._predicted = {t: next(p for p in preds if (p.label, p.bucket_bytes) == t)
                           for t in self._trials}
        pick = self._predicted[self._trials[0]]
        if not provisional:
            self.table, self.decision = auto_trials.record(pick, preds, self.network.notes,
                                                           self.flags)
            self._say("auto: decision\n" + self.table)
        return pick

    def switch(self, label: str, bucket_bytes: int | None = None) -> None:
        """Run ``label`` (a candidate) from the next forward, with ``bucket_bytes`` buckets
        (None: the wrapper's). Collective: call it on every rank at the same step. The
        old algorithm's residuals are flushed into the next gradients (module doc)."""
        if label not in {lb for lb, _ in self.candidates}:
            raise ValueError(f"auto: {label!r} is not a candidate; candidates: "
                             f"{', '.join(lb for lb, _ in self.candidates)}")
        self._adopt(label, bucket_bytes)

    def _adopt(self, label: str, bucket: int | None) -> None:
        """Make ``label`` the delegate (set up at the engine's next rebuild)."""
        if label != self.label:
            if self._steps > 0:
                self._leave(self.delegate, label)
            self.delegate, self.label = choose.make(label), label  # fresh state
            self._pending = True
        self._follow()
        self._bucket = bucket
        self._rebuild = True

    def _leave(self, old: Algorithm, new: str) -> None:
        """Flush or drop ``old``'s state before ``new`` takes over; log the switch."""
        feedback = getattr(old, "error_feedback", None) or getattr(old, "feedback", None)
        self._flush = feedback if isinstance(feedback, ErrorFeedback) else None
        if old.kind == "weight":
            old.synchronize()
        self._retired_bytes += old.bytes_sent() - self.ctx.comm.counter.total
        old.close()
        kept = "residuals flushed into the next gradient" if self._flush else "no residuals"
        event = {"step": self._steps, "from": self.label, "to": new, "state": kept}
        self.switches.append(event)
        self._say(f"auto: step {self._steps}: switching {self.label} -> {new} ({kept}; other "
                  "per-algorithm state such as momenta or warm-start factors is dropped)")

    def _say(self, text: str) -> None:
        log.info(text)
        if self.config.verbose and self.ctx.comm.rank == 0:
            print(text, file=sys.stderr, flush=True)

    # -- engine hooks --------------------------------------------------------------------
    def tensors(self, named_params: Sequence[tuple[str, nn.Parameter]]
                ) -> list[tuple[str, nn.Parameter]]:
        return self.delegate.tensors(named_params)

    def bucket_size_bytes(self) -> int | None:
        return self._bucket

    def need_reset(self) -> bool:
        """The first hook of every forward: closes the last step's timing row, advances
        the phases (profile -> tune -> watch) once per step, and asks for a rebuild when
        the delegate or the bucket size changed."""
        if self._advanced != self._steps and self._recorder is not None:
            self._advanced = self._steps
            self._recorder.forward_start()
            self._own = (self._own[1], 0.0)
            self._own_t0 = time.perf_counter()
            self._advance()
            self._own = (self._own[0], time.perf_counter() - self._own_t0)
        return self._rebuild or self.delegate.need_reset()

    def reset(self, ctx: AlgorithmContext) -> None:
        self._ctx = ctx
        if self._advanced == self._steps:  # this step's own time: deciding, rebuilding
            self._own = (self._own[0], time.perf_counter() - self._own_t0)
        if self._pending:
            self.delegate.setup(ctx)
        else:
            self.delegate.reset(ctx)
        self._pending = self._rebuild = False

    def before_forward(self) -> None:
        self.delegate.before_forward()

    def bucket_ready(self, bucket: Bucket) -> Handle[torch.Tensor] | None:
        if self._flush is not None:
            for e in bucket.entries:  # the old algorithm's unsent residual joins the step
                flat = bucket.flat[e.offset:e.offset + e.numel]
                residual = self._flush.residual(e.name)
                if residual is not None:
                    flat.add_(residual.reshape(-1))
        if self._recorder is None:  # one rank: nothing is timed
            return self.delegate.bucket_ready(bucket)
        with self._recorder.communicating():
            return self.delegate.bucket_ready(bucket)

    def after_backward(self) -> None:
        if self._recorder is None:
            self.delegate.after_backward()
        else:
            with self._recorder.communicating():  # decoding, waiting: not compute
                self.delegate.after_backward()
            self._recorder.backward_done()
        self._flush = None
        self._steps += 1

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.delegate.before_step(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.delegate.after_step(optimizer)

    def predicted_gradient(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        return self.delegate.predicted_gradient(name, grad)

    def synchronize(self) -> None:
        self.delegate.synchronize()

    # -- the phases (profile -> tune -> watch), at the start of a step -----------------
    def _advance(self) -> None:
        if self._phase == "profile" and self._steps >= self.config.profile_steps:
            self._finish_profile()
        elif choose.warming_up(self.delegate):  # not the predicted steps: time them later
            self._mark = self._steps
        elif self._phase == "tune" and self._steps > self._mark:
            self._tune_step()
        elif self._phase == "watch":
            self._watch()

    def _finish_profile(self) -> None:
        assert self._recorder is not None
        assert self._control is not None
        self.compute = measure.slowest(self._recorder.profile(self.config.profile_steps - 1),
                                       self._control.group)
        self._decide(self.compute)
        self._adopt(*self._trials[0])
        self._mark = self._steps
        if self.delegate.kind == "weight" or len(self._trials) == 1:
            self._phase = "watch"
            self._watcher.restart()
            return
        same = len({label for label, _ in self._trials}) == 1
        self._plan = auto_tune.visits(len(self._trials), self.config.tune_steps, same)
        self._phase, self._tuned = "tune", []

    def _tune_step(self) -> None:
        """One trial step done: its time, less auto's own and the rebuild's, is kept; the
        next visit of :attr:`_plan` starts, or every rank scores the trials on the slowest
        rank's times and keeps the best (:mod:`~hexagram.auto.tune`)."""
        assert self._recorder is not None and self._control is not None
        self._tuned.append(max(0.0, self._recorder.rows[-1].step_s - self._own[0]))
        done = list(itertools.accumulate(length for _, length in self._plan))
        if len(self._tuned) < done[-1]:
            if len(self._tuned) in done:  # the next visit
                nxt = self._trials[self._plan[done.index(len(self._tuned)) + 1][0]]
                if nxt != (self.label, self._bucket):
                    self._adopt(*nxt)
            return
        (label, bucket), score = auto_trials.best(self._control, self._tuned, self._plan,
                                                  self._trials, self.candidates, self.config)
        if (label, bucket) != (self.label, self._bucket):
            self._adopt(label, bucket)
        self._record_tuned(label, bucket, score)

    def _record_tuned(self, label: str, bucket: int, score: list[float]) -> None:
        """The decision notes the timed trials; watching starts (its normal: learnt)."""
        tuned = auto_tune.named(self._trials, score)
        one = len({lb for lb, _ in self._trials}) == 1
        assert self.decision is not None
        auto_trials.retimed(self.decision, self._predicted[(label, bucket)], tuned,
                            self.config.tie)
        self._watcher.restart()
        self._say(f"auto: timed {tuned} s/step ({len(self._tuned)} steps, "
                  f"{'medians of turns' if one else 'best step of each'}) -> {label} at "
                  f"{bucket / MB:g} MB")
        self._phase, self._mark = "watch", self._steps

    def _watch(self) -> None:
        """Count drifting steps; every 5 steps the ranks agree whether to re-probe."""
        assert self._recorder is not None and self._control is not None
        watcher, rows = self._watcher, self._recorder.rows
        if not rows:  # resumed: no step timed yet
            return
        watcher.observe(rows[-1].step_s)
        # ranks agree every 5 steps (a 1-float allreduce): a switch is at most 5 steps late
        if watcher.expected is None or self._steps % 5:
            return
        flag = group_tensor([watcher.drifting], self._control)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control.group)
        if flag.item() >= self.config.drift_steps:
            self._reprobe()

    def _reprobe(self) -> None:
        assert self.compute is not None and self._recorder is not None
        measured = statistics.median(r.step_s for r in self._recorder.rows[-5:])
        self._say(f"auto: step {self._steps}: step time {measured:.3f} s drifted from "
                  f"{self._watcher.expected:.3f} s for {self._watcher.drifting} steps: "
                  "probing again")
        self._measure_network()
        self.reprobes += 1
        before = self.label
        pick = self._decide(self.compute)
        if pick.label == before:
            self._watcher.restart(measured)  # same choice: the new normal
            return
        self._adopt(pick.label, pick.bucket_bytes)
        self._watcher.restart()
        self._mark = self._steps

    # -- accounting, checkpoints ---------------------------------------------------------
    def bytes_sent(self) -> int:
        """Every delegate's bytes since setup (the current one's count covers the shared
        communicator; retired delegates' own communicators are added)."""
        return self.delegate.bytes_sent() + self._retired_bytes

    def state_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "label": self.label, "bucket_bytes": self._bucket,
                "delegate": self.delegate.state_dict(), "switches": list(self.switches)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keep the saved decision (``redecide=True``: decide again after profiling)."""
        if self.config.redecide or state.get("decision") is None:
            return
        self.decision = dict(state["decision"])
        self.switches = list(state.get("switches", []))
        if state["label"] != self.label:
            self.delegate.close()
            self.delegate, self.label = choose.make(state["label"]), state["label"]
            self.delegate.setup(self.ctx)
        self._follow()
        self.delegate.load_state_dict(state["delegate"])
        self._bucket, self._pending, self._rebuild = state["bucket_bytes"], False, True
        self._mark = self._steps
        self._phase = "watch" if self._recorder is not None else "single"  # one rank
        self._watcher.restart()

    @property
    def exploring(self) -> bool:
        """True while auto profiles or times its trials (the choice is not final yet): a
        checkpoint saved now resumes by exploring again (see the module doc)."""
        return self._phase in ("profile", "tune")

    def close(self) -> None:
        self.delegate.close()
        if self._recorder is not None:
            self._recorder.close()
        if self._control is not None:
            self._control.close()
