"""Alert notifications (``fp8ops.notify``): what a notice says and its two formats, the URL taken
from the environment, one delivery with bounded retries against a real local HTTP server (up,
failing then recovering, refusing, down, slow), and the notifier's thread."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.webhook_server import WebhookServer, refused_url

from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.schema import Notifications
from fp8ops.notify import Notice, Notifier, RunInfo, Target, action_of, targets
from fp8ops.notify.delivery import DeliveryFailed, deliver
from fp8ops.notify.formats import SLACK_ALERTS, json_body, slack_body

MANIFESTS = Path(__file__).resolve().parents[1] / "manifests"
RUN = RunInfo(dir="/runs/a", id="0123abcd", name="tiny-gpt-cpu", host="node7")


def _alert(level="degrade", module="decoder.layers.1.mlp.linear_fc1", **extra):
    alert = {
        "step": 12,
        "level": level,
        "rule": "saturation",
        "module": module,
        "metric": "weight.saturation",
        "value": 0.0021,
        "threshold": 0.001,
        "message": f"step 12: {module} weight.saturation 0.0021 > {level} 0.001",
        "rank": 0,
    }
    return {**alert, **extra}


def _notice(*alerts) -> Notice:
    acted = [dict(a, action=action_of(a, proposed={"p"}, switched={"s"})) for a in alerts]
    return Notice(RUN, 12, tuple(acted))


# -- what a notice says ------------------------------------------------------------------------


def test_what_the_run_did_is_named_per_alert_and_for_the_notice():
    assert action_of(_alert("stop"), proposed=(), switched=()) == "stopped"
    assert action_of(_alert(module="s"), proposed={"s"}, switched={"s"}) == "auto-degraded"
    assert action_of(_alert(module="p"), proposed={"p"}, switched=()) == "proposed"
    assert action_of(_alert(module=None), proposed={"p"}, switched=()) == "logged"
    assert action_of(_alert("observe", module="p"), proposed={"p"}, switched=()) == "logged"
    notice = _notice(_alert("observe", module="p"), _alert(module="p"), _alert(module="s"))
    assert (notice.level, notice.did) == ("degrade", "auto-degraded")
    assert "switched s to BF16 from step 13" in notice.did_sentence()
    assert notice.look() == ["fp8ops alerts /runs/a", "fp8ops overrides list /runs/a"]
    assert [a["level"] for a in notice.at_least("degrade").alerts] == ["degrade", "degrade"]
    assert notice.at_least("stop") is None
    stopped = _notice(_alert(module="p"), _alert("stop"))
    assert stopped.did == "stopped" and "exits 3" in stopped.did_sentence()


def test_the_json_body_names_what_fired_where_what_the_run_did_and_how_to_look():
    body = json_body(_notice(_alert(module="p"), _alert("stop", value="nan")))
    assert body["run"] == {
        "dir": "/runs/a",
        "id": "0123abcd",
        "name": "tiny-gpt-cpu",
        "host": "node7",
    }
    assert (body["step"], body["level"], body["did"]) == (12, "stop", "stopped")
    assert body["look"] == ["fp8ops alerts /runs/a"]
    assert body["summary"].startswith("fp8ops STOP at step 12 in tiny-gpt-cpu on node7: step 12:")
    assert body["summary"].endswith("(+1 more)")
    first, second = body["alerts"]
    assert first == {
        "level": "degrade",
        "rule": "saturation",
        "module": "p",
        "metric": "weight.saturation",
        "value": 0.0021,
        "threshold": 0.001,
        "step": 12,
        "rank": 0,
        "message": "step 12: p weight.saturation 0.0021 > degrade 0.001",
        "action": "proposed",
    }
    assert (second["value"], second["action"]) == ("nan", "stopped")  # as in alerts.jsonl


def test_the_slack_body_lists_at_most_ten_alerts_and_escapes_markup():
    alerts = [_alert(module=f"decoder.layers.{i}.mlp.linear_fc1") for i in range(12)]
    body = slack_body(_notice(*alerts))
    assert body["text"].startswith("fp8ops DEGRADE at step 12 in tiny-gpt-cpu on node7")
    assert "&gt; degrade 0.001" in body["text"]  # '>' is Slack markup: escaped
    kinds = [block["type"] for block in body["blocks"]]
    assert kinds == ["header", "section"] + ["section"] * SLACK_ALERTS + ["section", "context"]
    assert body["blocks"][-2]["text"]["text"].startswith("... and 2 more")
    assert "`fp8ops alerts /runs/a`" in body["blocks"][-1]["elements"][0]["text"]
    assert "*logged*" in body["blocks"][2]["text"]["text"]


# -- the URL, from the environment only --------------------------------------------------------


def test_a_webhook_url_comes_from_the_environment_and_is_never_shown():
    settings = Notifications.model_validate(
        {"webhooks": [{"url_env": "HOOK_A", "format": "slack", "level": "stop"}]}
    )
    with pytest.raises(ManifestError, match=r"webhooks\[0\].url_env: .*HOOK_A is not set"):
        targets(settings, {})
    secret = "hooks.slack.com/services/T000/B000/XXXXSECRET"
    with pytest.raises(ManifestError) as not_a_url:
        targets(settings, {"HOOK_A": secret})
    assert "SECRET" not in str(not_a_url.value)
    [target] = targets(settings, {"HOOK_A": f"https://{secret}"})
    assert (target.url, target.format, target.level) == (f"https://{secret}", "slack", "stop")
    assert "SECRET" not in target.label()


def test_a_url_in_the_manifest_is_refused_without_repeating_it():
    tiny = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    webhook = {"url_env": "https://hooks.example/services/XXXXSECRET"}
    with pytest.raises(ManifestError) as refused:
        derive(tiny, {"notifications.webhooks": [webhook]}, "a URL where its variable belongs")
    assert "notifications.webhooks[0].url_env: must name the environment variable" in str(
        refused.value
    )
    assert "SECRET" not in str(refused.value)


# -- one delivery, against a real local server ----------------------------------------------------


def test_a_delivery_posts_json_once():
    with WebhookServer() as server:
        assert deliver(server.url, {"a": 1}, timeout=5, retries=3) == 1
    assert server.bodies() == [{"a": 1}]
    assert server.requests[0]["content_type"] == "application/json"


def test_a_server_error_is_tried_again_with_doubling_backoff():
    waits = []
    with WebhookServer(statuses=(503, 500, 200)) as server:
        tries = deliver(server.url, {"a": 1}, timeout=5, retries=3, wait=waits.append)
    assert tries == 3 and waits == [1.0, 2.0]
    assert server.bodies() == [{"a": 1}] * 3


def test_429_waits_what_retry_after_asks():
    waits = []
    with WebhookServer(statuses=(429, 200), headers={"Retry-After": "0.25"}) as server:
        assert deliver(server.url, {}, timeout=5, retries=1, wait=waits.append) == 2
    assert waits == [0.25]


def test_a_refusal_is_not_tried_again():
    waits = []
    with WebhookServer(statuses=(404,)) as server, pytest.raises(DeliveryFailed) as failed:
        deliver(server.url, {}, timeout=5, retries=3, wait=waits.append)
    assert (failed.value.tries, waits, len(server.requests)) == (1, [], 1)
    assert "HTTP 404" in str(failed.value) and "127.0.0.1" not in str(failed.value)


def test_a_server_that_is_down_fails_after_the_bounded_retries():
    waits = []
    url = refused_url()
    with pytest.raises(DeliveryFailed) as failed:
        deliver(url, {}, timeout=5, retries=2, wait=waits.append)
    assert failed.value.tries == 3 and waits == [1.0, 2.0]
    assert failed.value.reason == "Connection refused"
    assert url not in str(failed.value)


def test_a_slow_server_times_out_and_no_try_starts_past_the_time_left():
    with WebhookServer(delay=10.0) as server:
        started = time.perf_counter()
        with pytest.raises(DeliveryFailed) as failed:
            deliver(server.url, {}, timeout=0.3, retries=1, wait=lambda s: None)
        seconds = time.perf_counter() - started
        assert failed.value.reason == "timed out" and failed.value.tries == 2
        # Two tries of 0.3 s (measured: 0.6 s), not the server's 10 s: loose for a busy machine.
        assert seconds < 5.0
        with pytest.raises(DeliveryFailed, match="no time left"):
            deliver(server.url, {}, timeout=5, retries=3, time_left=lambda: 0.0)
        assert len(server.requests) == 2  # the last call started none


# -- the notifier's thread ---------------------------------------------------------------------


def _notifier(servers_and_levels, **kwargs):
    reports = []
    found = [
        Target(index, f"HOOK_{index}", format, level, url)
        for index, (url, format, level) in enumerate(servers_and_levels)
    ]
    notifier = Notifier(
        found,
        timeout=kwargs.pop("timeout", 5.0),
        retries=kwargs.pop("retries", 0),
        report=lambda kind, message, fields: reports.append((kind, message)),
        **kwargs,
    ).start()
    return notifier, reports


def test_each_webhook_gets_the_alerts_at_its_level_and_above():
    with WebhookServer() as plain, WebhookServer() as slack:
        notifier, reports = _notifier(
            [(plain.url, "json", "observe"), (slack.url, "slack", "stop")]
        )
        notifier.notify(_notice(_alert("observe")))
        notifier.notify(_notice(_alert("observe"), _alert("stop")))
        assert notifier.close(10)
    assert [[a["level"] for a in body["alerts"]] for body in plain.bodies()] == [
        ["observe"],
        ["observe", "stop"],
    ]
    [message] = slack.bodies()  # the first notice has nothing at stop
    assert message["text"].startswith("fp8ops STOP at step 12")
    assert reports == []
    assert notifier.summary()["webhooks"] == {
        "webhook 0 (HOOK_0, json)": {"sent": 2, "failed": 0},
        "webhook 1 (HOOK_1, slack)": {"sent": 1, "failed": 0},
    }


def test_a_webhook_that_is_down_is_reported_once_and_the_others_still_get_theirs():
    with WebhookServer() as up:
        notifier, reports = _notifier(
            [(refused_url(), "slack", "observe"), (up.url, "json", "observe")],
            retries=1,
            backoff=0.01,
        )
        for _ in range(3):
            notifier.notify(_notice(_alert()))
        assert notifier.close(10)
    assert len(up.bodies()) == 3
    assert [kind for kind, _ in reports] == ["notification_failed"]
    assert "webhook 0 (HOOK_0, slack) could not be told of step 12's alerts" in reports[0][1]
    assert "Connection refused (2 tries)" in reports[0][1]
    assert notifier.summary()["webhooks"]["webhook 0 (HOOK_0, slack)"] == {"sent": 0, "failed": 3}


@pytest.mark.slow
def test_closing_gives_a_slow_webhook_the_exit_wait_and_no_more():
    with WebhookServer(delay=5.0) as slow:
        notifier, reports = _notifier([(slow.url, "json", "observe")], timeout=5.0, retries=3)
        notifier.notify(_notice(_alert()))
        notifier.notify(_notice(_alert()))
        time.sleep(0.2)  # the first try is under way
        started = time.perf_counter()
        assert not notifier.close(0.5)
        seconds = time.perf_counter() - started
    # The exit wait (0.5 s), then at most a second for the try under way (measured: 1.5 s), and
    # less than the one try's 5 s however busy the machine.
    assert seconds < 4.5
    assert [kind for kind, _ in reports][-1] == "notifications_not_sent"
    assert "1 alert notification(s) could not be sent within 0.5 s" in reports[-1][1]
