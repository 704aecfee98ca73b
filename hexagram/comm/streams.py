"""CUDA streams for communication work, ordered with the training stream by events.

PyTorch DDP overlaps only NCCL's own kernels with backward. A Hexagram bucket also needs
compression, decompression and several collectives; issued on the default stream they
would serialise with the backward kernels. Each :class:`~hexagram.comm.communicator.
Communicator` therefore owns a side stream (:func:`side_stream`) and every job it runs is
ordered like this:

1. at submission, in the submitting thread: the side stream waits for everything already
   queued on the submitter's current stream (the bucket's gradients are written there):
   ``side.wait_stream(current)``;
2. the job (compress, collective, in-job decompress) runs with the side stream current, so
   its kernels and NCCL's stream synchronisation follow the side stream;
3. when its handle is waited: the waiter's current stream waits for the side stream
   (``current.wait_stream(side)``), no host block, and every tensor of the result is
   marked used on the waiter's stream (``record_stream``) so the caching allocator does not
   hand its memory to the side stream while the training stream still reads it.

Off CUDA every function here is a no-op: the same code runs on the CPU with the same
results.

Example:
    >>> side_stream(torch.device("cpu")) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["StreamJob", "consume", "join_stream", "mark", "on_stream", "side_stream",
           "tensors_in"]


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A new CUDA stream on ``device`` for communication work; None off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.Stream(device=device)


class StreamJob:
    """A job ordered after the submitter's current stream and run on a side stream (steps
    1-2 of the module docstring); ``event`` marks its end on that stream once it ran.

    Built in the submitting thread (that is when the side stream starts waiting); called
    in any thread. Without a stream it just calls the job.
    """

    def __init__(self, stream: torch.cuda.Stream | None, job: Callable[[], Any]) -> None:
        self.stream, self.job = stream, job
        self.event: torch.cuda.Event | None = None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))

    def __call__(self) -> Any:
        if self.stream is None:
            return self.job()
        with torch.cuda.stream(self.stream):
            try:
                return self.job()
            finally:  # also on failure: a waiter must never wait on a missing event
                self.event = torch.cuda.Event()
                self.event.record(self.stream)


def on_stream(stream: torch.cuda.Stream | None, job: Callable[[], Any]) -> StreamJob:
    """:class:`StreamJob` of ``job`` on ``stream`` (call in the submitting thread)."""
    return StreamJob(stream, job)


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value`` (a tensor, or lists/tuples/dicts of them, or objects with
    a ``tensors`` attribute such as payloads)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(getattr(value, "tensors", None), (list, tuple)):
        yield from tensors_in(value.tensors)


def join_stream(job: StreamJob | None, result: Any) -> None:
    """Step 3: the caller's current stream waits for ``job``'s end on its side stream (an
    event: later jobs on that stream are not waited); ``result``'s CUDA tensors are
    recorded as used on the caller's stream. Call it after the job ran."""
    if job is None or job.stream is None or job.event is None:
        return
    current = torch.cuda.current_stream(job.stream.device)
    if current == job.stream:
        return
    current.wait_event(job.event)
    for t in tensors_in(result):
        if t.is_cuda:
            t.record_stream(current)


def mark(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on the calling thread's current stream of ``device`` (None
    off CUDA): hand it with tensors made here to another thread, which :func:`consume`\\ s."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def consume(event: torch.cuda.Event | None, tensors: Any) -> None:
    """Before using ``tensors`` made on another stream: the current stream waits for
    ``event`` (from :func:`mark`) and the tensors are recorded as used on it."""
    if event is None:
        return
    current = torch.cuda.current_stream()
    current.wait_event(event)
    for t in tensors_in(tensors):
        if t.is_cuda:
            t.record_stream(current)
