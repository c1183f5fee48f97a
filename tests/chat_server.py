"""An OpenAI-compatible server on 127.0.0.1 (``/v1/chat/completions`` and ``/v1/completions``)
whose answers a test scripts (status, body, headers, delay), for the eval's endpoint clients;
and servers that accept and never answer."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Reply = tuple[int, object, dict[str, str], float]
"""(status, JSON body or raw text, headers, seconds to wait before answering)"""


class _Handler(BaseHTTPRequestHandler):
    server: _ChatServer

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, payload: object, headers: dict[str, str]) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (timeout test)

    def do_GET(self) -> None:
        if self.path.rstrip("/") == "/v1/models":
            models = [{"id": name, "object": "model"} for name in self.server.models]
            self._send(200, {"object": "list", "data": models}, {})
        else:
            self._send(404, {"error": "not found"}, {})

    def do_POST(self) -> None:
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._send(404, {"error": "not found"}, {})
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        with server.lock:
            server.paths.append(self.path)
            server.bodies.append(body)
            server.auth.append(self.headers.get("Authorization"))
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
        try:
            status, payload, headers, delay = server.reply(body)
            time.sleep(delay)
        finally:
            # counted until just before answering: the client cannot send its next request
            # before it has the answer, so this never over-counts the client's concurrency
            with server.lock:
                server.in_flight -= 1
        self._send(status, payload, headers)


class _ChatServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, reply: Callable[[dict], Reply], models: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply = reply
        self.models = models
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.in_flight = 0
        self.max_in_flight = 0


@contextmanager
def chat_server(reply: Callable[[dict], Reply], models: list[str]) -> Iterator[_ChatServer]:
    server = _ChatServer(reply, models)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def completion(message: dict, finish_reason: str = "stop") -> dict:
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {"completion_tokens": 7},
    }


@contextmanager
def silent_server(trickle_s: float | None = None) -> Iterator[int]:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers (or, with
    ``trickle_s``, sends a status line and headers, then one byte of body every ``trickle_s``
    seconds, for ever); yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stop = threading.Event()
    held: list[socket.socket] = []

    def hold(connection: socket.socket) -> None:
        if trickle_s is None:
            return
        try:
            connection.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n"
            )
            while not stop.wait(trickle_s):
                connection.sendall(b" ")
        except OSError:
            pass

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            held.append(connection)
            threading.Thread(target=hold, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        listener.close()
        for connection in held:
            connection.close()
