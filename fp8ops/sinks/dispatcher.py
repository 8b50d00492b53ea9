"""The sinks' thread: records in through a bounded queue, items out to every sink.

What the training step does is :meth:`Dispatcher.put`: a record onto a queue, never waiting.
The thread opens the sinks, turns records into items (:mod:`fp8ops.sinks.items`,
:mod:`fp8ops.sinks.layers`) and writes them, a batch at a time. So that neither a slow sink nor
a failing one reaches training:

* a full queue drops the record and counts it; the first drop is reported (``report``), the
  count when the segment ends;
* a sink that raises (its server down, the disk full) is reported once, with what it raised,
  and written to no more in this run segment (a resume opens it again); the others go on;
* :meth:`close` waits a bounded time for the queue to drain and the sinks to close, then lets
  the thread go (it is a daemon: the process may end with it).

``report(kind, message, fields)`` is the caller's (``fp8ops.train.reporting``: a line on stderr
and an event in ``events.jsonl``).
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fp8ops.sinks.base import Sink
from fp8ops.sinks.items import Checkpointed, Ended, Item, Scalars, Text, from_alerts, from_record
from fp8ops.sinks.layers import worst_modules
from fp8ops.sinks.state import read_state, write_state

Report = Callable[[str, str, dict[str, Any]], None]

CAPACITY = 10_000  # records; a step queues a few (its row, its layers, an event or alerts)
BATCH = 256  # records turned into one write per sink
_POLL = 0.2  # seconds between looks at the queue while closing


class Dispatcher:
    """Writes the run's records to ``sinks`` from a thread of its own; ``state_file``:
    ``sinks.json``; ``modules``: the names of a telemetry row's modules, in its order."""

    def __init__(
        self,
        sinks: list[Sink],
        *,
        state_file: Path,
        report: Report,
        modules: list[str],
        worst: int,
        every_steps: int = 1,
        start_step: int = 0,
        capacity: int = CAPACITY,
    ):
        self.sinks = list(sinks)
        self.state_file, self.report = state_file, report
        self.modules, self.worst, self.every_steps = modules, worst, every_steps
        self.step = start_step  # the last step seen, for an event that names none
        self.outcome: str | None = None
        self.dropped = 0
        self.failed: dict[str, str] = {}  # sink name -> what it raised
        self.written = {sink.name: 0 for sink in self.sinks}
        self.skipped = {sink.name: 0 for sink in self.sinks}
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp8ops-sinks", daemon=True)

    def start(self) -> Dispatcher:
        self._thread.start()
        atexit.register(self.close)  # a trainer used without fp8ops' start-up still closes
        return self

    # -- the training step's side: never waits ---------------------------------------------------

    def record(self, file: str, record: dict[str, Any]) -> None:
        """A record the run appended (:meth:`fp8ops.run.RunDir.listen`)."""
        self.put(("record", file, record))

    def layers(self, step: int, row) -> None:
        """The step's telemetry row (``[modules, metrics]``), already a copy of its own."""
        if self.worst:
            self.put(("layers", step, row))

    def alerts(self, alerts: list[dict[str, Any]]) -> None:
        """The step's alerts, each with the ``action`` the run took."""
        self.put(("alerts", alerts))

    def put(self, entry: tuple) -> None:
        if self._closing.is_set():
            return  # what the run records while it ends (this thread's own report included)
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                self.report(
                    "sink_records_dropped",
                    f"metric sinks fell {self._queue.maxsize} records behind; records are "
                    "dropped (and counted) rather than slow training. The run's own files "
                    "have them all",
                    {},
                )

    # -- the end -----------------------------------------------------------------------------

    def close(self, wait: float = 60.0) -> bool:
        """Let the thread write what is queued and close the sinks, waiting at most ``wait``
        seconds; whether it finished. Safe to call twice."""
        atexit.unregister(self.close)
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(wait)
        if self._thread.is_alive():
            self.report(
                "sinks_not_closed",
                f"metric sinks were still writing {self._queue.qsize()} records after {wait:g} "
                "s; the run ends without waiting for them (its own files have everything)",
                {"queued": self._queue.qsize()},
            )
            return False
        return True

    def summary(self) -> dict[str, Any]:
        """What was sent, per sink: for the event that closes the segment."""
        return {
            "written": self.written,
            "already_sent": self.skipped,
            "failed": self.failed,
            "dropped": self.dropped,
        }

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        saved = read_state(self.state_file)
        for sink in list(self.sinks):
            self._call(sink, "open", lambda sink=sink: sink.open(saved.get(sink.name, {})))
        self._save_state()
        while True:
            try:
                batch = [self._queue.get(timeout=_POLL)]
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            while len(batch) < BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._handle(batch)
        for sink in list(self.sinks):
            self._call(sink, "close", lambda sink=sink: sink.close(self.outcome))
        self._save_state()

    def _handle(self, batch: list[tuple]) -> None:
        items: list[Item] = []
        for entry in batch:
            items += self._items(entry)
        pending: list[Scalars | Text] = []
        for item in items:
            if isinstance(item, Scalars | Text):
                pending.append(item)
                continue
            self._write(pending)
            pending = []
            if isinstance(item, Checkpointed):
                for sink in list(self.sinks):
                    self._call(sink, "flush", sink.flush)
                self._save_state()
            elif isinstance(item, Ended):
                self.outcome = item.outcome
        self._write(pending)

    def _items(self, entry: tuple) -> list[Item]:
        kind = entry[0]
        if kind == "record":
            _, file, record = entry
            items = from_record(file, record, step=self.step, every_steps=self.every_steps)
            if file == "metrics.jsonl":
                self.step = int(record["step"])
            return items
        if kind == "layers":
            _, step, row = entry
            if step % self.every_steps:
                return []
            return [Scalars(step, worst_modules(self.modules, row, self.worst))]
        return from_alerts(entry[1])

    def _write(self, items: list[Scalars | Text]) -> None:
        if not items:
            return
        for sink in list(self.sinks):
            fresh = [item for item in items if item.step > sink.skip_through]
            self.skipped[sink.name] += len(items) - len(fresh)
            if fresh and self._call(sink, "write", lambda s=sink, f=fresh: s.write(f)):
                self.written[sink.name] += len(fresh)

    def _call(self, sink: Sink, what: str, call: Callable[[], None]) -> bool:
        """``call`` (one of ``sink``'s), a sink that raises reported once and dropped."""
        try:
            call()
            return True
        except Exception as exc:  # noqa: BLE001 - a sink's failure must never reach training
            self.sinks.remove(sink)
            error = f"{type(exc).__name__}: {exc}"
            self.failed[sink.name] = error
            self.report(
                "sink_failed",
                f"metric sink {sink.name} failed ({what}) at step {self.step} and is off for the "
                f"rest of this run segment (a resume opens it again); training goes on. {error}",
                {"sink": sink.name, "during": what, "step": self.step, "error": error},
            )
            return False

    def _save_state(self) -> None:
        state = read_state(self.state_file)
        for sink in self.sinks:
            try:
                state[sink.name] = sink.state()
            except Exception:  # noqa: BLE001 - a sink that cannot say keeps its last entry
                continue
        try:
            write_state(self.state_file, state)
        except OSError as exc:
            self.report(
                "sink_state_not_saved",
                f"{self.state_file} could not be written ({exc}); a resume may start new W&B "
                "and MLflow runs",
                {"error": str(exc)},
            )
