"""What the trainer tells the outside world: the metric sinks (``fp8ops.sinks``) and the alert
notifications (``fp8ops.notify``) of the manifest's ``logging`` and ``notifications`` sections,
opened by rank 0 for one run segment (:meth:`Reporting.open`) and closed when it ends, however it
ends (``startup.start``: completed, paused, interrupted, stopped by an alert, failed).

The sinks follow the run's own records as they are appended (``RunDir.listen``); the trainer
hands over what is in no record: each step's telemetry row (:meth:`Reporting.layers`) and each
step's alerts with what the run did about them (:meth:`Reporting.alerts`). Every call only
queues; the work is the sinks' and the notifications' threads'. Elsewhere than on rank 0, and
for a manifest that names no sink and no webhook, every call does nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from typing import Any

import numpy as np

from fp8ops import notify, sinks
from fp8ops.manifest import content_dict, manifest_hash
from fp8ops.manifest.canonical import to_yaml
from fp8ops.manifest.schema import Manifest
from fp8ops.run import RunDir, read_run_record

SINKS_WAIT = 60.0  # seconds the end of a run waits at most for the sinks to finish writing


class Reporting:
    def __init__(
        self,
        run: RunDir | None = None,
        dispatcher: sinks.Dispatcher | None = None,
        notifier: notify.Notifier | None = None,
        *,
        run_info: notify.RunInfo | None = None,
        exit_wait: float = 0.0,
    ):
        self.run, self.dispatcher, self.notifier = run, dispatcher, notifier
        self.run_info, self.exit_wait = run_info, exit_wait

    @classmethod
    def open(
        cls, run: RunDir, manifest: Manifest, *, start_step: int, modules: list[str]
    ) -> Reporting:
        """Rank 0's sinks and webhooks for ``run`` from ``start_step`` (its threads started);
        an inert one elsewhere. ``modules``: a telemetry row's modules, in its order."""
        wanted_sinks = manifest.logging.configured
        if not run.writer or not (wanted_sinks or manifest.notifications.webhooks):
            return cls()
        run_id = read_run_record(run.path).run_id
        report = _reporter(run)
        dispatcher = None
        if wanted_sinks:
            context = sinks.RunContext(
                run_dir=run.path.resolve(),
                name=manifest.name,
                manifest_hash=manifest_hash(manifest),
                run_id=run_id,
                start_step=start_step,
                manifest_yaml=to_yaml(manifest),
                config=content_dict(manifest),
            )
            dispatcher = sinks.Dispatcher(
                sinks.make_sinks(manifest.logging, context),
                state_file=run.layout.sinks,
                report=report,
                modules=modules,
                worst=manifest.logging.worst_modules,
                every_steps=manifest.logging.every_steps,
                start_step=start_step,
            ).start()
            run.listen(dispatcher.record)
        notifier = None
        if manifest.notifications.webhooks:
            settings = manifest.notifications
            notifier = notify.Notifier(
                notify.targets(settings),
                timeout=settings.timeout_seconds,
                retries=settings.retries,
                report=report,
            ).start()
        info = notify.RunInfo(
            dir=str(run.path.resolve()), id=run_id, name=manifest.name, host=os.uname().nodename
        )
        return cls(
            run,
            dispatcher,
            notifier,
            run_info=info,
            exit_wait=manifest.notifications.exit_wait_seconds,
        )

    def layers(self, step: int, row: np.ndarray | None) -> None:
        """The step's telemetry row (every stage's modules), for the per-layer summary."""
        if self.dispatcher is not None and row is not None:
            self.dispatcher.layers(step, np.array(row, copy=True))  # the caller may reuse it

    def alerts(
        self,
        alerts: list[dict[str, Any]],
        *,
        proposed: Collection[str] = (),
        switched: Collection[str] = (),
    ) -> None:
        """A step's gathered alerts (after ``alerts.jsonl`` has them): ``proposed``, the modules
        whose BF16 override was proposed; ``switched``, those the auto-degrade policy switched."""
        if not alerts or (self.dispatcher is None and self.notifier is None):
            return
        acted = [
            dict(a, action=notify.action_of(a, proposed=proposed, switched=switched))
            for a in alerts
        ]
        if self.dispatcher is not None:
            self.dispatcher.alerts(acted)
        if self.notifier is not None:
            step = max(int(a["step"]) for a in acted)
            self.notifier.notify(notify.Notice(self.run_info, step, tuple(acted)))

    def close(self) -> None:
        """Send what is queued, within bounded waits, and record what was sent. Never raises:
        it runs as the run ends, and how the run ended is what must be reported."""
        notifier, dispatcher = self.notifier, self.dispatcher
        self.dispatcher = self.notifier = None
        try:
            if notifier is not None:
                notifier.close(self.exit_wait)
                self.run.event("notifications_closed", **notifier.summary())
            if dispatcher is not None:
                dispatcher.close(SINKS_WAIT)
                self.run.event("sinks_closed", **dispatcher.summary())
        except Exception as exc:  # noqa: BLE001 - secondary to how the run ended
            print(f"warning: closing the metric sinks and webhooks: {exc}", file=sys.stderr)


def _reporter(run: RunDir):
    """How the threads report a problem: a line on stderr and an event (``kind``)."""

    def report(kind: str, message: str, fields: dict[str, Any]) -> None:
        print(f"warning: {message}", file=sys.stderr)
        run.event(kind, message=message, **fields)

    return report
