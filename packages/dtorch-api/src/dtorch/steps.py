"""Step capture and replay (issue #12 item 2): `dtorch.compile(step)` runs a repeated step as a program.

    @dtorch.compile
    def train_step(x, y):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

The first call runs eagerly (warm-up: optimizers make their state, autograd its gradients). The second runs
eagerly too and is recorded, then defined at the controller as a program (`InstrDefine`). From the third on,
the user's Python still runs (autograd, modules, optimizers keep their Python state), but each DTorch
operation is only *matched* against the program: nothing is planned, encoded or emitted, and the step ends
with one `InstrReplay(program, tensor ids, seeds, numbers)`.

`dtorch.compile(train_step, mode="graph")` goes further, as a CUDA graph does: once a replay has matched the
whole program (the third call), later calls do not run the Python at all; they check the arguments, send the
replay and return new DTensors. This holds only where the program does not depend on Python state that
changes between calls (the rules, and what is checked and what is not, are at the top of `dtorch/_graph.py`);
the step says with a warning when it cannot be a graph, and stays a replay.

Automatic capture does the same without marking a step (on by default; `dtorch.auto_compile(False)` turns it off):
the operations between two sync points or uploads are one. The rules of both are at the top of
`dtorch/_capture.py`, which records and replays.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from dtorch import _capture, _dispatch, _graph
from dtorch._capture import AutoSteps, Program, _Recorder, _Replayer
from dtorch.runtime import get_session
from dtorch.session import Session

MODES = ("replay", "graph")


class Compiled:
    """A step function run as a captured program from its third call on (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], warmup: int = 1, mode: str = "replay") -> None:
        if mode not in MODES:
            raise ValueError(f"dtorch.compile: mode={mode!r}; expected one of {', '.join(map(repr, MODES))}")
        functools.update_wrapper(self, fn)
        self.fn, self.warmup, self.mode = fn, warmup, mode
        self.session: Session | None = None  # the one its program is defined in
        self._begin(None)
        self.replays = 0  # calls that ran as one InstrReplay
        self.graphed = 0  # of those, calls that did not run the Python (mode="graph")
        self.fallbacks = 0  # replays that fell back to eager (rule 3)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = get_session()
        auto = session.step
        if type(auto) is not AutoSteps:
            return self._call(session, args, kwargs)
        auto.interrupt("a compiled step")  # it ends the automatic step and is one of its own (rule 7)
        auto.pause()
        try:
            return self._call(session, args, kwargs)
        finally:
            auto.arm()

    def _begin(self, session: Session | None) -> None:
        """A session's first call of the step (another session's program is unknown to this one: it starts over,
        warm-up included)."""
        self.session, self.calls = session, 0
        self.program: Program | None = None
        self.unreplayable: str | None = None  # why the step always runs eagerly (rule 5)
        self.graph: _graph.Graph | None = None
        self.no_graph: str | None = None  # why a mode="graph" step replays with its Python (_graph rule 1)
        self.default_dtype = torch.get_default_dtype()  # the one its program was recorded under (`_torch_state`)

    def _call(self, session: Session, args: tuple, kwargs: dict) -> Any:
        if session is not self.session:
            self._begin(session)
        if torch.get_default_dtype() is not self.default_dtype:  # its ops were planned under another: record again
            self.default_dtype, self.program, self.graph = torch.get_default_dtype(), None, None
        self.calls += 1
        if self.unreplayable is not None or self.calls <= self.warmup or _dispatch.step_hook is not None \
                or session.step is not None:
            return self.fn(*args, **kwargs)
        if self.graph is not None:
            result = self.graph(session, args, kwargs)
            if result is not _graph.MISS:
                self.replays += 1
                self.graphed += 1
                return result
            if self.graph.broken is not None:
                self._refuse(self.graph.broken, 4)
            self.graph = None  # the Python runs, as a replay that verifies again (_graph rule 2)
        if self.program is None:
            return self._record(session, args, kwargs)
        verify = self.mode == "graph" and self.no_graph is None
        mode = (_graph.Verifier if verify else _Replayer)(session, self.program)
        mode.install()
        try:
            result = self.fn(*args, **kwargs)
        except BaseException:
            mode.fall_back()
            raise
        mode.finish()
        if mode.fell_back:
            self.fallbacks += 1
            self.program = None  # record again next time
        else:
            self.replays += 1
            if verify:
                self._make_graph(mode, args, kwargs, result)
        return result

    def _make_graph(self, verifier: _graph.Verifier, args: tuple, kwargs: dict, result: Any) -> None:
        graph = _graph.graph_of(verifier, args, kwargs, result)
        if isinstance(graph, str):
            self._refuse(graph, 5)
        else:
            self.graph = graph

    def _refuse(self, why: str, stacklevel: int) -> None:  # (stacklevel: the user's call of the step)
        self.no_graph = why
        warnings.warn(f"dtorch.compile: {getattr(self.fn, '__qualname__', self.fn)} replays with its Python "
                      f"(mode='graph' refused): {why}", stacklevel=stacklevel)

    def _record(self, session: Session, args: tuple, kwargs: dict) -> Any:
        mode = _Recorder(session, session.new_program_id())
        mode.install()
        try:
            result = self.fn(*args, **kwargs)
        except BaseException:
            mode.abandon("it raised")
            raise
        program = mode.finish()
        if program is None:
            self.unreplayable = mode.broken
            warnings.warn(f"dtorch.compile: {getattr(self.fn, '__qualname__', self.fn)} runs eagerly: "
                          f"{mode.broken}", stacklevel=3)
        else:
            self.program = program
            session.emit(_capture._definition(session, program))
        return result


def compile(fn: Callable[..., Any] | None = None, *, warmup: int = 1, mode: str = "replay") -> Any:  # noqa: A001
    """Run `fn` (a training or inference step over DTensors) as a captured program: call 1..`warmup` eagerly,
    the next one recorded, later ones replayed with only (program id, tensor ids, seeds) sent. Use as
    `@dtorch.compile` or `dtorch.compile(fn, warmup=2)`. `mode="graph"`: once a replay has matched, later calls
    do not run `fn`'s Python at all (as a CUDA graph; what that requires is in `dtorch/_graph.py`); the step
    warns and stays a replay where it cannot."""
    if fn is None:
        return lambda f: Compiled(f, warmup, mode)
    return Compiled(fn, warmup, mode)


def auto_compile(enabled: bool = True) -> AutoSteps | None:
    """Turn automatic capture on or off for the current session (on by default: `dtorch.connect`). Steps are
    found without marking them: the operations between two sync points (such as `loss.item()`) or uploads are
    one, and a step that repeats runs as a program, as `dtorch.compile`'s do. Returns the session's automatic
    capture (it counts `replays` and `fallbacks`), or None when off."""
    session = get_session()
    auto = session.step
    if type(auto) is AutoSteps:
        if not enabled:
            auto.close()
        return auto if enabled else None
    if auto is not None or _dispatch.step_hook is not None:
        raise RuntimeError("dtorch.auto_compile() cannot be called inside a dtorch.compile step or a CommDebugMode "
                           "block")
    if not enabled:
        return None
    auto = AutoSteps(session)
    auto.arm()
    return auto
