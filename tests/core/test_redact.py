"""Secrets redacted at the edges (issue #32 items 2-3).

On main ``lingo eval -m 'u=http://dave:PW@host/v1#m'`` printed the password and wrote it into
``results.json``, ``report.md`` and ``report.html``; ``lingo status RUN --endpoint
http://carol:PW@host`` and ``AWS_ENDPOINT_URL=http://eve:PW@host lingo data-prep --source
s3://…`` printed it. The end-to-end tests here run the real CLI in a process of its own with
secrets planted in the URLs and the environment, and grep everything the run left: stdout,
stderr, every file under its output folder (results, reports, logs).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_server import chat_server, completion
from hypothesis import given
from hypothesis import strategies as st

LINGO = str(Path(sys.executable).with_name("lingo"))
PLANTED = {
    "AWS_SECRET_ACCESS_KEY": "aws-SECRET-0123456789",
    "AWS_SESSION_TOKEN": "aws-SESSION-0123456789",
    "MLFLOW_TRACKING_PASSWORD": "mlflow-PASSWORD-0123",
    "KFP_TOKEN": "kfp-TOKEN-0123456789",
    "HF_TOKEN": "hf_TOKEN0123456789",
    "OPENAI_API_KEY": "sk-OPENAI-0123456789",
}
PASSWORD = "url-PASSWORD-4242"
MASK = "***"
SECRETS = [*PLANTED.values(), PASSWORD]


def _leaks(*texts: str) -> list[str]:
    return [secret for secret in SECRETS if any(secret in text for text in texts)]


def _files(folder: Path) -> dict[str, str]:
    return {
        str(path): path.read_bytes().decode(errors="replace")
        for path in folder.rglob("*")
        if path.is_file()
    }


def _lingo(args: list[str], env: dict[str, str] | None = None, **kwargs):
    return subprocess.run(
        [LINGO, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **PLANTED, **(env or {})},
        **kwargs,
    )


def test_urls_lose_their_credentials():
    from core.redact import redact

    assert redact("http://dave:PW@host:8000/v1") == "http://dave:***@host:8000/v1"
    assert redact("https://ghp_TOKEN@github.com/x") == "https://***@github.com/x"
    assert redact("ssh://git@github.com/x") == "ssh://git@github.com/x"  # a user name
    signed = "https://b.s3.amazonaws.com/k?X-Amz-Credential=AK%2F1&X-Amz-Signature=abc&x=1"
    assert redact(signed) == (
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***&x=1"
    )
    assert redact("GET /a?token=zz&api_key=yy&sig=s&max_tokens=512") == (
        "GET /a?token=***&api_key=***&sig=***&max_tokens=512"
    )
    assert redact("password=hunter2 key='v'") == "password=*** key='***'"
    assert redact("Authorization: Bearer eyJ.abc") == "Authorization: Bearer ***"
    assert redact("max_tokens=512 api_key_env=OPENAI_API_KEY") == (
        "max_tokens=512 api_key_env=OPENAI_API_KEY"
    )


def test_secret_variables_and_url_passwords_in_the_environment():
    from core.redact import redact, redact_data, secret_values

    environ = {
        "AWS_SECRET_ACCESS_KEY": "abcdefgh12345",
        "AWS_ENDPOINT_URL": "http://eve:evepass99@host",
        "MY_TOKEN": "short",  # too short to mask
        "HOME": "/root/longer-than-eight",  # not a secret's name
    }
    assert secret_values(environ) == ["abcdefgh12345", "evepass99"]
    text = "key abcdefgh12345, pass evepass99, home /root/longer-than-eight, short"
    assert redact(text, secret_values(environ)) == (
        "key ***, pass ***, home /root/longer-than-eight, short"
    )
    data = {"password": "x", "api_key_env": "OPENAI_API_KEY", "urls": ["http://a:b@c"]}
    assert redact_data(data, []) == {
        "password": MASK,
        "api_key_env": "OPENAI_API_KEY",
        "urls": ["http://a:***@c"],
    }


@given(
    user=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=12),
    password=st.text(
        alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789%!$&'()*+,;=._~-",
        min_size=4,
        max_size=30,
    ),
    path=st.sampled_from(["", "/", "/v1", "/v1#model", "?x=1"]),
)
def test_no_url_password_survives(user, password, path):
    from core.redact import redact

    for template in ("{u}", "error: {u} failed", "'{u}'", '"{u}"', "({u})", "<{u}>"):
        text = template.format(u=f"http://{user}:{password}@host.example:8000{path}")
        assert f":{password}@" not in redact(text, [])


def test_log_records_are_redacted_whatever_the_handler(caplog):
    from core.redact import install

    install()
    logging.getLogger("lingo.test").warning("connecting to %s", "http://u:pw1234@host")
    try:
        raise RuntimeError("http://u:pw5678@host refused")
    except RuntimeError:
        logging.getLogger("lingo.test").exception("failed")
    text = "\n".join(caplog.messages) + caplog.text
    assert "pw1234" not in text and "pw5678" not in text
    assert "http://u:***@host" in text


def test_lingo_eval_of_an_endpoint_url_with_a_password_writes_no_secret(tmp_path):
    answer = completion({"content": "Voici.", "reasoning_content": "Je réfléchis."})
    with chat_server(lambda body: (200, answer, {}, 0.0), ["m"]) as server:
        url = f"http://dave:{PASSWORD}@127.0.0.1:{server.server_port}/v1#m"
        result = _lingo(
            ["--verbose", "eval", "-m", f"u={url}", "--limit", "2", "-o", str(tmp_path)]
        )
        assert server.auth[0] is not None  # the credentials still reach the server
    assert result.returncode == 0, result.stderr
    files = _files(tmp_path)
    assert {"results.json", "report.md", "report.html"} <= {Path(p).name for p in files}
    assert not _leaks(result.stdout, result.stderr, *files.values())
    assert f"http://dave:{MASK}@127.0.0.1" in files[str(tmp_path / "results.json")]


def test_lingo_status_with_a_password_in_the_endpoint_prints_no_secret():
    result = _lingo(
        ["--verbose", "status", "run-1", "--endpoint", f"http://carol:{PASSWORD}@127.0.0.1:9"]
    )
    assert result.returncode == 1
    assert "http://carol:***@127.0.0.1:9" in result.stderr
    assert not _leaks(result.stdout, result.stderr)


def test_data_prep_from_s3_with_a_password_in_aws_endpoint_url_prints_no_secret(tmp_path):
    env = {"AWS_ENDPOINT_URL": f"http://eve:{PASSWORD}@127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"}
    env |= {"AWS_ACCESS_KEY_ID": "testing"}
    result = _lingo(
        ["--verbose", "data-prep", "--source", "s3://bucket/rows", "-o", str(tmp_path)], env
    )
    assert result.returncode == 1 and "error:" in result.stderr
    assert not _leaks(result.stdout, result.stderr, *_files(tmp_path).values())


def test_a_local_run_prints_and_logs_no_secret(tmp_path):
    # the data source carries a token: kfp.local prints every task's arguments into the run's
    # log, and the failing step's error names the source (an s3:// source is left to its step
    # by the pre-check; the endpoint is a closed port, so the step fails at once)
    source = f"s3://data-bucket/rows.jsonl?token={PASSWORD}"
    result = _lingo(
        ["run", "--local", "-o", str(tmp_path), "--set", f"data_prep.source={source}"],
        env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_MAX_ATTEMPTS": "1"},
    )
    assert result.returncode == 1 and "step 'data-prep' failed" in result.stderr
    files = _files(tmp_path)
    assert any(name.endswith(".log") for name in files)
    assert not _leaks(result.stdout, result.stderr, *files.values())


# -- issue #44 item 1: a password in an endpoint URL without a label -----------------------------


def test_a_label_made_from_a_url_never_holds_its_password():
    # on d393f04 the label of 'http://u:PW@127.0.0.1:1/v1#m' was 'u:PW@127.0.0.1:1': printed
    # in the error line, written to report.md/html and results.json, and an MLflow param key
    from eval.runner import ModelSpec

    spec = ModelSpec.parse(f"http://dave:{PASSWORD}@127.0.0.1:8000/v1#m")
    assert (spec.label, spec.served_model) == ("127.0.0.1:8000", "m")
    assert ModelSpec.parse(f"https://{PASSWORD}@vllm:443/v1").label == "vllm:443"


def test_user_and_password_without_a_scheme_are_redacted():
    from core.redact import redact

    assert redact("error: u:PW1@127.0.0.1:1: 1/1 failed") == "error: u:***@127.0.0.1:1: 1/1 failed"
    assert redact('key "model.dave:p@ss@h:18095"') == 'key "model.dave:***@h:18095"'
    assert redact("mail john@example.com at 12:30") == "mail john@example.com at 12:30"
    assert redact("ssh://git@github.com/x") == "ssh://git@github.com/x"


def test_mlflow_keys_made_from_labels_are_valid():
    from mlflow.utils.validation import _validate_metric_name, _validate_param_name

    from eval.report import mlflow_label

    for label in ["127.0.0.1:8000", "a@b", "..", ".hidden", "sft v2", "x/y", "é"]:
        key = mlflow_label(label)
        _validate_param_name(f"model.{key}")
        _validate_metric_name(f"{key}/mean_reward")
    assert mlflow_label("gpt-oss-20b.v2") == "gpt-oss-20b.v2"


def test_the_models_words_are_not_redacted_in_the_results(tmp_path):
    # issue #44 item 9: on d393f04 results.json's "the bearer of good news" became
    # "the bearer ***": redaction is for what the project says, not for the model's text
    from eval.eval_config import EvalConfig
    from eval.report import load_results
    from eval.runner import run_eval

    text = "He was the bearer of good news: password=hunter2 is what he said."
    answer = completion({"content": text, "reasoning_content": "Je calcule."})
    with chat_server(lambda body: (200, answer, {}, 0.0), ["m"]) as server:
        url = f"http://dave:{PASSWORD}@127.0.0.1:{server.server_port}/v1#m"
        run_eval([url], EvalConfig(limit=1), tmp_path)
    written = load_results(tmp_path)
    assert written["responses"][0]["final"] == text
    assert written["models"][0]["location"].startswith("http://dave:***@127.0.0.1")
    assert "bearer of good news" in (tmp_path / "report.md").read_text()


def test_terminal_controls_are_escaped_in_what_the_project_prints():
    from core.redact import for_console

    assert for_console("HTTP 400: \x1b[2J\x1b[31mPWNED\r") == "HTTP 400: \\x1b[2J\\x1b[31mPWNED\\r"
    assert for_console("a\tb\nc \u202eevil é") == "a\tb\nc \\u202eevil é"


@pytest.mark.slow  # the CLI in its own process and an MLflow sqlite store: ~60 s
def test_lingo_eval_with_a_password_and_mlflow_leaks_nothing_and_prints_no_escape(tmp_path):
    # issue #44 item 1 end to end (and item 9's ANSI escapes and model text): on d393f04 the
    # error line, report.md, report.html and results.json held the password, and with
    # MLFLOW_TRACKING_URI set a 76-line traceback printed it three times
    text = "La réponse est 168. He was the bearer of good news."
    answer = completion({"content": text, "reasoning_content": "Je calcule 35 % de 480."})
    calls = {"n": 0}

    def reply(body):
        calls["n"] += 1
        if calls["n"] == 2:
            return (400, "\x1b[2J\x1b[31mPWNED\x1b[0m", {}, 0.0)
        return (200, answer, {}, 0.0)

    out, db = tmp_path / "out", tmp_path / "mlflow.db"
    env = {**os.environ, **PLANTED, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    with chat_server(reply, ["m"]) as server:
        url = f"http://dave:{PASSWORD}@127.0.0.1:{server.server_port}/v1#m"
        args = ["eval", "-m", url, "--limit", "2", "--retries", "0", "-o", str(out)]
        result = subprocess.run(
            [sys.executable, "-m", "pipelines", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
    label = f"127.0.0.1:{server.server_port}"
    assert result.returncode == 1  # 1 of 2 responses failed: past the 10% threshold
    assert result.stderr.splitlines()[-1].startswith(f"error: {label}: 1/2 responses failed")
    assert "Traceback" not in result.stderr and "\x1b" not in result.stdout + result.stderr
    assert "\\x1b[2J" in result.stderr  # shown, escaped, not obeyed
    files = _files(out)
    assert not _leaks(
        result.stdout, result.stderr, *files.values(), db.read_bytes().decode("latin-1")
    )
    results = json.loads(files[str(out / "results.json")])
    assert results["models"][0]["label"] == label
    assert [r["final"] for r in results["responses"] if not r["error"]] == [text]
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{db}")
    (run,) = mlflow.search_runs(search_all_experiments=True, output_format="list")
    assert run.data.params[f"model.127.0.0.1_{server.server_port}"].startswith("http://dave:***@")
