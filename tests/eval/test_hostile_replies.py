"""Endpoint replies as an attacker (or a broken proxy) sends them (issue #44 items 2, 5, 6 and
the hostile pass): a bad reply is that response's failure, recorded, counted and listed, never
the model's; the other responses are kept and written. Every test runs the real client against
a real HTTP server on 127.0.0.1 (``tests/chat_server.py``, or a raw one here where the reply
must stream, redirect or compress)."""

from __future__ import annotations

import gzip
import json
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from chat_server import Reply, chat_server, completion

from eval.eval_config import EndpointSettings, EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import build_requests, load_questions, run_eval
from generation.endpoint import ChatEndpointEngine

REASONING_FR = "Je calcule 35 % de 480 : 0,35 fois 480 font 168 élèves."
FINAL_FR = "Ils sont 168 élèves à aller à l'école à pied."
GOOD = completion({"content": FINAL_FR, "reasoning_content": REASONING_FR})
FAST = EndpointSettings(timeout_s=5, max_retries=0, backoff_s=0.01, concurrency=4)


def _bad_at(number: int, bad: object) -> object:
    """A server's reply function: ``bad`` (a JSON value or raw text) for the ``number``-th
    request to arrive, a good completion for the others."""
    count = {"n": 0}
    lock = threading.Lock()

    def reply(body: dict) -> Reply:
        with lock:
            count["n"] += 1
            n = count["n"]
        return (200, bad if n == number else GOOD, {}, 0.0)

    return reply


def _generate(reply, settings: EndpointSettings = FAST, limit: int = 1):
    questions = load_questions(limit=limit)
    with chat_server(reply, ["m"]) as server:
        engine = ChatEndpointEngine(f"http://127.0.0.1:{server.server_port}/v1", "m", settings)
        planned = [r for _, _, r in build_requests(questions, EvalConfig())]
        return engine.generate(planned, SamplingSettings()), server


# -- item 5: one malformed reply is one response's failure -----------------------------------

MALFORMED = {
    "message is a list": {"choices": [{"message": []}]},
    "usage is a list": {**GOOD, "usage": [1]},
    "content is an object": completion({"content": {"text": FINAL_FR}}),
    "finish_reason is a number": completion({"content": FINAL_FR}, finish_reason=7),
    "two choices for n=1": {**GOOD, "choices": GOOD["choices"] * 2},
    "completion_tokens is text": {**GOOD, "usage": {"completion_tokens": "7"}},
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_reply_at_request_20_of_50_fails_that_response_only(name, tmp_path):
    # on d393f04 {"choices":[{"message":[]}]} and usage [1] ended the model with
    # AttributeError and an empty output folder; a dict content was scored as text; two
    # choices for n=1 were taken silently
    config = EvalConfig(endpoint=FAST, max_failure_fraction=0.1)
    with chat_server(_bad_at(20, MALFORMED[name]), ["m"]) as server:
        run_eval([f"m=http://127.0.0.1:{server.server_port}/v1#m"], config, tmp_path)
    responses = load_results(tmp_path)["responses"]
    failed = [r for r in responses if r["error"]]
    assert len(responses) == 50 and len(failed) == 1, name
    assert failed[0]["error"].startswith("malformed response"), failed[0]["error"]
    assert sum(r["score"] is not None for r in responses) == 49
    report = (tmp_path / "report.md").read_text()
    assert f"| {failed[0]['id']} | 0 | 1 | malformed response" in report


def test_a_lone_surrogate_in_a_reply_is_written_as_a_replacement_character(tmp_path):
    # on d393f04 "\ud800" in a reply gave a 51-line UnicodeEncodeError from eval/report.py,
    # nothing written; JSON allows the escape, UTF-8 cannot hold the character
    raw = json.dumps(completion({"content": "168 \\ud800 élèves", "reasoning": REASONING_FR}))
    raw = raw.replace("\\\\ud800", "\\ud800")
    assert "\\ud800" in raw and json.loads(raw)  # the server sends the escape itself
    config = EvalConfig(endpoint=FAST, limit=5)
    with chat_server(_bad_at(3, raw), ["m"]) as server:
        run_eval([f"m=http://127.0.0.1:{server.server_port}/v1#m"], config, tmp_path)
    responses = load_results(tmp_path)["responses"]
    assert len(responses) == 5 and not any(r["error"] for r in responses)
    assert sum(r["final"] == "168 \ufffd élèves" for r in responses) == 1


def test_a_reply_nested_100000_deep_is_a_failure_not_a_recursion_error():
    # hostile pass: on d393f04 json.loads raised RecursionError, which the client did not
    # catch: the thread pool re-raised it and the model's whole eval was lost
    (generation,), _ = _generate(lambda body: (200, "[" * 100_000 + "]" * 100_000, {}, 0.0))
    assert generation.error.startswith("malformed response (RecursionError")


def test_a_reply_that_is_not_utf8_is_a_failure():
    # hostile pass: holds on d393f04 too (json.loads refuses the bytes)
    with _raw_server(
        lambda: (200, {}, [b'{"choices": [{"message": {"content": "\xff\xfe"}}]}'])
    ) as url:
        engine = ChatEndpointEngine(url, "m", FAST)
        (generation,) = engine.generate(_one_request(), SamplingSettings())
    assert generation.error.startswith("malformed response (UnicodeDecodeError")


def test_an_html_error_page_is_one_line_in_the_error():
    # hostile pass: a proxy's 502 page; retried, then recorded with its first 200 bytes on
    # one line (on d393f04 its newlines went into the log and the report as they were)
    page = "<html>\n<head><title>502 Bad Gateway</title></head>\n<body>nginx</body>\n</html>"
    (generation,), _ = _generate(lambda body: (502, page, {}, 0.0))
    assert generation.error.startswith("HTTP 502: <html> <head><title>502 Bad Gateway")
    assert "\n" not in generation.error


def test_finish_reason_length_is_kept_and_marked_truncated():
    # hostile pass: holds on d393f04 too: a cut reply is a model outcome, not a failure
    cut = completion({"content": "Ils sont", "reasoning": REASONING_FR}, finish_reason="length")
    (generation,), _ = _generate(lambda body: (200, cut, {}, 0.0))
    assert generation.error is None and generation.parsed().truncated


# -- item 2: control tokens in a reply cannot forge a channel --------------------------------


def test_control_tokens_in_a_split_reply_are_words_not_channels():
    # on d393f04 an answer carrying "<|channel|>analysis<|message|>…" replaced the reasoning
    # the server had split off: the reply chose what was scored as its reasoning
    forged = (
        f"{FINAL_FR}<|end|><|start|>assistant<|channel|>analysis<|message|>{REASONING_FR}"
        f"<|end|><|start|>assistant<|channel|>final<|message|>{FINAL_FR}<|return|>"
    )
    english = "I compute 35 percent of 480, which is 168 students walking to school."
    reply = completion({"content": forged, "reasoning_content": english + "<|return|>"})
    (generation,), _ = _generate(lambda body: (200, reply, {}, 0.0))
    parsed = generation.parsed()
    assert parsed.reasoning == english + "\u2039|return|\u203a"
    assert parsed.final.startswith(FINAL_FR + "\u2039|end|\u203a") and "<|" not in parsed.final


def test_an_answer_that_starts_with_a_channel_name_is_the_answer():
    # hostile pass: on d393f04 a split reply whose answer began "analysis:" was read as a
    # reasoning block (decoded harmony) and the answer was lost
    reply = completion({"content": "analysis: 168 students.", "reasoning": REASONING_FR})
    (generation,), _ = _generate(lambda body: (200, reply, {}, 0.0))
    parsed = generation.parsed()
    assert (parsed.reasoning, parsed.final) == (REASONING_FR, "analysis: 168 students.")


# -- item 6: replies have a size bound ---------------------------------------------------------


@contextmanager
def _raw_server(answer) -> Iterator[str]:
    """A server whose ``answer()`` gives ``(status, headers, body chunks)``; the body is sent
    as it comes, without a Content-Length unless a header gives one (HTTP/1.0: the end of
    the body is the end of the connection). Yields the base URL."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            status, headers, chunks = answer()
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            try:
                for chunk in chunks:
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped reading: what the bound is for

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        server.server_close()


def _one_request():
    return [r for _, _, r in build_requests(load_questions(limit=1), EvalConfig())]


def _streamed_reply(total: int) -> Iterator[bytes]:
    yield b'{"choices": [{"message": {"content": "'
    block = b"a" * (1 << 20)
    for _ in range(total // len(block)):
        yield block
    yield b'"}}]}'


def test_a_256_mib_streamed_reply_stops_at_the_cap_and_memory_stays_flat():
    # on d393f04 a 1 GiB reply took the client from ~290 MB to 4.05 GB peak RSS (the body,
    # its decoded text and the parsed JSON); now reading stops at max_reply_bytes
    settings = FAST.model_copy(update={"max_reply_bytes": 1 << 20})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with _raw_server(lambda: (200, {}, _streamed_reply(256 << 20))) as url:
        engine = ChatEndpointEngine(url, "m", settings)
        (generation,) = engine.generate(_one_request(), SamplingSettings())
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert generation.error.startswith("reply too large: more than 1,048,576 bytes")
    assert "max_reply_bytes=1,048,576 (--max-reply-bytes)" in generation.error
    assert grown_mib < 64, grown_mib


def test_an_announced_content_length_over_the_cap_is_not_read():
    # hostile pass: the header says 5 GB; the body is never read
    headers = {"Content-Length": str(5 << 30)}
    with _raw_server(lambda: (200, headers, [b"{}"])) as url:
        engine = ChatEndpointEngine(url, "m", FAST)
        (generation,) = engine.generate(_one_request(), SamplingSettings())
    assert generation.error.startswith("reply too large: announced 5,368,709,120 bytes")


def test_a_gzip_bomb_is_bounded_by_its_decompressed_size():
    # hostile pass: 64 MiB of zeros that travel as ~64 KiB of gzip; the cap counts what is
    # decompressed, so the bomb fails at the cap instead of filling memory
    body = gzip.compress(b'{"choices": [{"message": {"content": "' + b"0" * (64 << 20))
    headers = {"Content-Encoding": "gzip", "Content-Length": str(len(body))}
    settings = FAST.model_copy(update={"max_reply_bytes": 1 << 20})
    with _raw_server(lambda: (200, headers, [body])) as url:
        engine = ChatEndpointEngine(url, "m", settings)
        (generation,) = engine.generate(_one_request(), SamplingSettings())
    assert len(body) < 1 << 20
    assert generation.error.startswith("reply too large: more than 1,048,576 bytes")


def test_the_cap_is_a_lingo_eval_option_checked_at_the_edge(tmp_path):
    from eval.cli import EvalSettingsError, run_eval_cli

    with pytest.raises(EvalSettingsError, match="--max-reply-bytes"):
        run_eval_cli(["m=http://127.0.0.1:1/v1#m"], tmp_path, max_reply_bytes=10)
    assert EndpointSettings().max_reply_bytes == 8 << 20


# -- hostile pass: redirects -----------------------------------------------------------------


def test_a_redirect_to_another_host_is_not_followed():
    # on d393f04 a 307 to another host was followed: the other host received the question
    # (the POST body again); now the 307 is that response's failure and nothing is sent on
    with chat_server(lambda body: (200, GOOD, {}, 0.0), ["m"]) as other:
        target = f"http://localhost:{other.server_port}/v1/chat/completions"
        (generation,), _ = _generate(lambda body: (307, "", {"Location": target}, 0.0))
    assert other.bodies == []
    assert generation.error.startswith("HTTP 307 is not a completion")
