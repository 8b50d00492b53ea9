"""The bodies a webhook is sent: a generic JSON object (:func:`json_body`) and Slack's
incoming-webhook message (:func:`slack_body`), both from a :class:`~fp8ops.notify.notice.Notice`.

The JSON object (``"format": 1``)::

    {"source": "fp8ops", "format": 1, "run": {"dir", "id", "name", "host"}, "step", "level",
     "did", "summary", "look": ["fp8ops alerts RUN_DIR", ...],
     "alerts": [{"level", "rule", "module", "metric", "value", "threshold", "step", "rank",
                 "message", "action"}, ...]}

``value`` and ``threshold`` are numbers, or ``"nan"``, ``"inf"``, ``"-inf"`` (as in
``alerts.jsonl``). Slack's message has a one-line ``text`` (what notifications and clients
without blocks show) and ``blocks``: a header, the run, what it did, a section per alert (at
most :data:`SLACK_ALERTS`, then how many more) and the commands to look.
"""

from __future__ import annotations

from typing import Any

from fp8ops.alerts.records import decode_float, format_value
from fp8ops.notify.notice import Notice

SLACK_ALERTS = 10  # alerts listed one by one in a Slack message (it allows 50 blocks)
_SLACK_TEXT = 2900  # a section's text may hold 3,000 characters
_ICON = {
    "observe": ":large_blue_circle:",
    "degrade": ":large_orange_circle:",
    "stop": ":red_circle:",
}


def summary(notice: Notice) -> str:
    """One line: level, step, run, host, the first alert's sentence and how many more."""
    first, more = notice.alerts[0], len(notice.alerts) - 1
    extra = f" (+{more} more)" if more else ""
    return (
        f"fp8ops {notice.level.upper()} at step {notice.step} in {notice.run.name} on "
        f"{notice.run.host}: {first['message']}{extra}"
    )


def json_body(notice: Notice) -> dict[str, Any]:
    keys = ("level", "rule", "module", "metric", "value", "threshold", "step", "rank")
    return {
        "source": "fp8ops",
        "format": 1,
        "run": {
            "dir": notice.run.dir,
            "id": notice.run.id,
            "name": notice.run.name,
            "host": notice.run.host,
        },
        "step": notice.step,
        "level": notice.level,
        "did": notice.did,
        "summary": summary(notice),
        "look": notice.look(),
        "alerts": [
            {**{k: a.get(k) for k in keys}, "message": a["message"], "action": a["action"]}
            for a in notice.alerts
        ],
    }


def slack_body(notice: Notice) -> dict[str, Any]:
    run = notice.run
    blocks: list[dict[str, Any]] = [
        {
            "type": "header",
            "text": {
                "type": "plain_text",
                "text": f"fp8ops: {notice.level} alert at step {notice.step}"[:150],
            },
        },
        _section(
            f"*run* `{_escape(run.name)}` (id `{_escape(str(run.id))}`) on `{_escape(run.host)}`"
            f"\n*directory* `{_escape(run.dir)}`\n*the run* {_escape(notice.did_sentence())}"
        ),
    ]
    for alert in notice.alerts[:SLACK_ALERTS]:
        blocks.append(_section(_alert_text(alert)))
    hidden = len(notice.alerts) - SLACK_ALERTS
    if hidden > 0:
        blocks.append(_section(f"... and {hidden} more: all of them are in alerts.jsonl"))
    blocks.append(
        {
            "type": "context",
            "elements": [
                {
                    "type": "mrkdwn",
                    "text": "look: " + "  ".join(f"`{_escape(c)}`" for c in notice.look()),
                }
            ],
        }
    )
    return {"text": _escape(summary(notice)), "blocks": blocks}


def _alert_text(alert: dict[str, Any]) -> str:
    where = f"`{alert['rule']}`"
    if alert.get("module"):
        where += f" on `{_escape(alert['module'])}`"
    if alert.get("metric"):
        value = format_value(decode_float(alert.get("value")))
        threshold = format_value(decode_float(alert.get("threshold")))
        where += f": `{_escape(alert['metric'])}` = {value} (threshold {threshold})"
    rank = f", rank {alert['rank']}" if alert.get("rank") is not None else ""
    return (
        f"{_ICON[alert['level']]} *{alert['level']}* {where} at step {alert['step']}{rank}: "
        f"*{alert['action']}*\n{_escape(alert['message'])}"
    )


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": text[:_SLACK_TEXT]}}


def _escape(text: str) -> str:
    # Slack's mrkdwn reads &, < and > as markup (links, mentions).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


FORMATS = {"json": json_body, "slack": slack_body}
