"""Run a function off the critical path: a worker thread on the CPU, a side stream on CUDA.

Used for ``async_decompositions``: the decompositions of a step's factors run
while later steps train, and are collected at a fixed later step. On CPU the
LAPACK calls release the GIL, so the thread computes while the main thread
runs forward and backward. On CUDA the thread launches its kernels on a side
stream that first waits for everything already queued (the factors it reads),
and :meth:`Background.result` makes the current stream wait for it.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Callable, Generic, Optional, TypeVar

import torch

T = TypeVar("T")


class Background(Generic[T]):
    """``fn()`` started now on ``device``'s background worker; :meth:`result` waits for it."""

    def __init__(self, fn: Callable[[], T], device: torch.device) -> None:
        self._value: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(device))
        # Not a daemon: the interpreter waits for the work at exit. A daemon thread is cut off mid-call there, which
        # aborts the process when the call is in C++ (cuSOLVER on a GPU: "terminate called without an active
        # exception"). The work is local (no communication), so the wait is bounded by one decomposition.
        self._thread = threading.Thread(target=self._run, args=(fn,), name="ds_kfac-background", daemon=False)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            with torch.no_grad(), torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                self._value = fn()
        except BaseException as err:  # re-raised in the caller's thread by result()
            self._error = err

    def result(self) -> T:
        """The value of ``fn()`` (its exception re-raised here); may be called more than once."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        return self._value
