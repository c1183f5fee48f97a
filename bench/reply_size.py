"""Peak memory of the eval's endpoint client when a server streams a huge reply.

A server on 127.0.0.1 (a thread of this process) answers one chat completion whose
``content`` is ``--mib`` MiB of ``a``, streamed in 1 MiB blocks without a Content-Length; the
client (``generation.endpoint.ChatEndpointEngine``) asks once, with ``max_reply_bytes`` at its
default (8 MiB). The server holds only one block at a time, so the process's peak RSS is the
client's. Prints the outcome and the peak RSS (``resource.getrusage``), or run it under
``/usr/bin/time -v`` for "Maximum resident set size". Issue #44 item 6's figures
(docs/reliability.md) come from::

    /usr/bin/time -v python bench/reply_size.py --mib 1024
"""

from __future__ import annotations

import argparse
import resource
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = b"a" * (1 << 20)


def _server(mib: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends with the connection

        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            try:
                self.wfile.write(b'{"choices": [{"message": {"content": "')
                for _ in range(mib):
                    self.wfile.write(BLOCK)
                self.wfile.write(b'"}, "finish_reason": "stop"}]}')
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading at its cap

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="size of the reply's content")
    args = parser.parse_args()

    from eval.eval_config import EndpointSettings, EvalConfig
    from eval.runner import build_requests, load_questions
    from generation.endpoint import ChatEndpointEngine

    server = _server(args.mib)
    settings = EndpointSettings(timeout_s=60, request_timeout_s=600, max_retries=0)
    engine = ChatEndpointEngine(f"http://127.0.0.1:{server.server_port}/v1", "m", settings)
    request = [r for _, _, r in build_requests(load_questions(limit=1), EvalConfig())]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (generation,) = engine.generate(request, EvalConfig().sampling.params)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    outcome = generation.error or f"{len(generation.text):,} characters of text"
    print(f"reply of {args.mib} MiB: {outcome[:120]}")
    print(f"peak RSS before the request {before:.0f} MiB, after {peak:.0f} MiB")
    server.shutdown()


if __name__ == "__main__":
    main()
