"""The ``notifications`` section: webhooks told of alerts as they fire. The manifest names the
environment variable that holds each webhook's URL, never the URL: a webhook URL is a secret
(Slack's carries its token), and a manifest is copied into the run directory, its revisions
and every checkpoint."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, field_validator
from pydantic_core import PydanticCustomError

from fp8ops.manifest.base import SECRET, Section, added_field, list_to_tuple


class Webhook(Section):
    """One webhook: where (the variable holding its URL), in which format, from which level."""

    url_env: str = added_field(
        added_in="0.1.0",
        description=(
            "The environment variable holding the webhook's URL (e.g. FP8OPS_SLACK_WEBHOOK); "
            "a run refuses to start while it is unset."
        ),
    )
    format: Literal["json", "slack"] = added_field(
        "json",
        added_in="0.1.0",
        description=(
            "json: the alerts as one JSON object (docs/telemetry.md); slack: Slack's "
            "incoming-webhook message ({text, blocks})."
        ),
    )
    level: Literal["observe", "degrade", "stop"] = added_field(
        "degrade",
        added_in="0.1.0",
        description="Alerts at this level and above are sent (observe < degrade < stop).",
    )

    @field_validator("url_env")
    @classmethod
    def _a_variable_name(cls, value: str) -> str:
        if "://" in value:
            raise PydanticCustomError(
                SECRET,
                "must name the environment variable that holds the URL, not the URL (a webhook "
                "URL is a secret, and the manifest is copied into the run directory): e.g. "
                "url_env: FP8OPS_SLACK_WEBHOOK, then export FP8OPS_SLACK_WEBHOOK=https://...",
            )
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError("must be an environment variable name: letters, digits and '_'")
        return value


class Notifications(Section):
    """Webhooks told of each step's alerts, after ``alerts.jsonl`` has them: what fired, where,
    what the run did and the command to look. Sent by rank 0 from a background thread, with
    bounded retries; a webhook that cannot be reached is reported and never stops training."""

    webhooks: Annotated[tuple[Webhook, ...], BeforeValidator(list_to_tuple)] = added_field(
        (), added_in="0.1.0", description="The webhooks; none by default."
    )
    timeout_seconds: float = added_field(
        5.0,
        added_in="0.1.0",
        gt=0,
        le=60,
        description="How long one try waits for the webhook's answer.",
    )
    retries: int = added_field(
        3,
        added_in="0.1.0",
        ge=0,
        le=10,
        description=(
            "Tries after the first, on a connection error, a timeout, HTTP 429 or 5xx, waiting "
            "1, 2, 4, ... seconds between them (a 4xx other than 429 is not retried)."
        ),
    )
    exit_wait_seconds: float = added_field(
        10.0,
        added_in="0.1.0",
        ge=0,
        le=600,
        description=(
            "When the run ends (a Stop alert included), how long it waits at most for "
            "notifications still being sent before the process exits."
        ),
    )
