"""Every wait on an OpenAI-compatible endpoint is bounded and configurable (issue #32 item 10).

On main an endpoint that accepts connections and never answers cost 490 s for one question
(4 attempts × 120 s read timeout, plus backoff), with no option to bound it. The servers here
are real sockets on 127.0.0.1 that accept and never answer (or trickle one byte at a time).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_server import silent_server

from eval.eval_config import EndpointSettings, EvalConfig, SamplingSettings
from eval.runner import TooManyFailuresError, build_requests, load_questions, run_eval
from generation.endpoint import ChatEndpointEngine

LINGO = str(Path(sys.executable).with_name("lingo"))


def _generate(port: int, settings: EndpointSettings, questions: int):
    engine = ChatEndpointEngine(f"http://127.0.0.1:{port}/v1", "m", settings)
    planned = build_requests(load_questions(limit=questions), EvalConfig())
    began = time.monotonic()
    generations = engine.generate([r for _, _, r in planned], SamplingSettings())
    return generations, time.monotonic() - began


def test_a_request_to_a_silent_endpoint_ends_within_its_bound():
    settings = EndpointSettings(
        timeout_s=0.4, connect_timeout_s=0.5, request_timeout_s=1.5, max_retries=3, backoff_s=0.05
    )
    with silent_server() as port:
        (generation,), seconds = _generate(port, settings, 1)
    assert generation.failed and seconds < 3.0, seconds  # main: 4 × 120 s + backoff
    assert "request_timeout_s=1.5 s (--request-timeout)" in generation.error
    assert "Timeout" in generation.error  # the last attempt's failure is kept
    assert generation.attempts >= 2  # the bound leaves room for retries


def test_a_trickling_endpoint_cannot_hold_a_request_past_its_bound():
    # each read gets a byte before the read timeout: only the request's bound stops it
    settings = EndpointSettings(timeout_s=1.0, request_timeout_s=1.0, max_retries=0)
    with silent_server(trickle_s=0.05) as port:
        (generation,), seconds = _generate(port, settings, 1)
    assert generation.failed and seconds < 2.5, seconds
    assert "request_timeout_s=1 s" in generation.error


def test_the_run_bound_ends_every_request_of_a_model():
    settings = EndpointSettings(
        timeout_s=30, request_timeout_s=30, run_timeout_s=1.0, concurrency=2, max_retries=0
    )
    with silent_server() as port:
        generations, seconds = _generate(port, settings, 10)
    assert seconds < 3.0, seconds  # 10 questions, 2 at a time, each otherwise 30 s
    assert all(g.failed and "run_timeout_s=1 s (--run-timeout)" in g.error for g in generations)


def test_run_eval_fails_with_one_clear_error_and_keeps_what_it_wrote(tmp_path):
    config = EvalConfig(
        limit=2,
        endpoint=EndpointSettings(timeout_s=0.3, request_timeout_s=0.6, max_retries=1),
    )
    with silent_server() as port, pytest.raises(TooManyFailuresError, match="2/2 responses"):
        run_eval([f"silent=http://127.0.0.1:{port}/v1#m"], config, tmp_path)
    assert (tmp_path / "results.json").is_file()


def test_lingo_eval_takes_the_bounds_as_options(tmp_path):
    with silent_server() as port:
        began = time.monotonic()
        result = subprocess.run(
            [
                LINGO, "eval", "-m", f"silent=http://127.0.0.1:{port}/v1#m", "--limit", "1",
                "--timeout", "0.3", "--connect-timeout", "0.5", "--request-timeout", "1",
                "--run-timeout", "5", "--retries", "2", "-o", str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
        seconds = time.monotonic() - began
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    assert "silent: 1/1 responses failed" in errors[0] and "--request-timeout" in errors[0]
    assert seconds < 60, seconds  # the interpreter's start-up; the request itself ends in 1 s
    bad = subprocess.run(
        [LINGO, "eval", "-m", "x=/none", "--request-timeout", "0", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "--request-timeout 0.0: Input should be greater than 0" in (
        bad.stderr
    )
