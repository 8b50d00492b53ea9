"""A real HTTP server on the loopback interface, in a thread, standing in for a webhook: it
records what it is sent and answers as the test scripts it (a status per request, a delay)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class WebhookServer:
    """``statuses``: the answer to each request in turn (the last one repeats); ``delay``:
    seconds to sleep before answering; ``headers``: sent with every answer."""

    def __init__(self, statuses=(200,), *, delay: float = 0.0, headers: dict | None = None):
        self.statuses, self.delay, self.headers = list(statuses), delay, headers or {}
        self.requests: list[dict] = []  # {"body", "content_type", "time"}
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = self.rfile.read(length)
                with server._lock:
                    server.requests.append(
                        {
                            "body": json.loads(body),
                            "content_type": self.headers.get("Content-Type"),
                            "time": time.monotonic(),
                        }
                    )
                    index = min(len(server.requests), len(server.statuses)) - 1
                    status = server.statuses[index]
                time.sleep(server.delay)
                try:
                    self.send_response(status)
                    for name, value in server.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:  # the client gave up (a timeout): nothing to answer
                    pass

            def log_message(self, *args):  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def bodies(self) -> list[dict]:
        with self._lock:
            return [r["body"] for r in self.requests]


def refused_url() -> str:
    """The URL of a loopback port nothing listens on: connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/hook"
