"""Alert notifications: webhooks told of a step's alerts as they fire, as the manifest's
``notifications`` section names them (docs/telemetry.md).

Reading order: ``notice`` (what a notification says: the alerts, what the run did, where to
look), ``formats`` (the generic JSON body and Slack's), ``delivery`` (one POST with bounded
retries and backoff), ``worker`` (the thread and its bounded queue, off the training step's
path). Only rank 0 sends; the trainer's side is ``fp8ops.train.reporting``.

A webhook's URL comes from the environment variable the manifest names (``url_env``), read
when the run starts (:func:`targets`), and is never written anywhere: not in the manifest, the
run directory, a message or an event.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

from fp8ops.errors import ManifestError
from fp8ops.manifest.schema import Notifications
from fp8ops.notify.notice import Notice, RunInfo, action_of
from fp8ops.notify.worker import Notifier, Target

__all__ = ["Notice", "Notifier", "RunInfo", "Target", "action_of", "check_environment", "targets"]


def targets(notifications: Notifications, environ: Mapping[str, str] = os.environ) -> list[Target]:
    """The webhooks with their URLs from ``environ``; a ManifestError names the field and the
    variable (never its value) when one is unset or not an http(s) URL."""
    found = []
    for index, webhook in enumerate(notifications.webhooks):
        field = f"notifications.webhooks[{index}].url_env"
        url = environ.get(webhook.url_env, "").strip()
        if not url:
            raise ManifestError(
                f"{field}: the environment variable {webhook.url_env} is not set; export it with "
                "the webhook's URL (it stays out of the manifest and the run directory), or "
                "remove the webhook"
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ManifestError(
                f"{field}: {webhook.url_env} does not hold an http:// or https:// URL with a host "
                "(its value is not shown: a webhook URL is a secret)"
            )
        found.append(Target(index, webhook.url_env, webhook.format, webhook.level, url))
    return found


def check_environment(
    notifications: Notifications, environ: Mapping[str, str] = os.environ
) -> None:
    """Refuse to start a run whose webhooks' variables are unset or hold no URL."""
    targets(notifications, environ)
