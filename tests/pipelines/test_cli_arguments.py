"""Bad command-line arguments are one line naming the argument (issue #44, item 9: runs, CLI).

On main each of these was a traceback (43 lines for an endpoint), an answer of "fits" for a
model that cannot exist, a compiled pipeline naming a runtime Kubernetes refuses, or an error
blaming the wrong option.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from pipelines import cli
from pipelines.kfp_client import CronError, cron_with_seconds

TINY_CONFIG = {
    "model_type": "gpt_oss",
    "vocab_size": 600,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
}


def _invoke(args: list[str], env: dict | None = None):
    result = CliRunner().invoke(cli.app, args, env=env)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result.exit_code, errors


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_hidden_layers", -4, "num_hidden_layers must be between 1 and"),
        ("num_hidden_layers", "two", "num_hidden_layers must be a whole number, got 'two'"),
        ("hidden_size", 1e308, "hidden_size must be between 1 and"),
        ("num_local_experts", 0, "num_local_experts must be between 1 and"),
        ("num_hidden_layers", 0, "num_hidden_layers must be between 1 and"),
        ("num_attention_heads", 0, "num_attention_heads must be between 1 and"),
        ("num_experts_per_tok", 99, "num_experts_per_tok 99 is more than num_local_experts 4"),
        ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide"),
    ],
)
def test_estimate_of_an_impossible_model_config_is_one_line(field, value, message, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**TINY_CONFIG, field: value}))
    code, errors = _invoke(["estimate", "--model", str(config), "--layout", "tiny-cpu"])
    assert code == 2 and len(errors) == 1 and message in errors[0], errors


def test_estimate_of_the_same_config_unchanged_still_works(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    code, errors = _invoke(["estimate", "--model", str(config), "--layout", "tiny-cpu"])
    assert code == 0 and not errors


def test_estimate_with_an_infinite_gpu_memory_is_one_line():
    code, errors = _invoke(["estimate", "--set", "gpu_memory_gib=inf"])
    assert code == 2 and len(errors) == 1 and "gpu_memory_gib" in errors[0], errors
    assert "finite" in errors[0]


@pytest.mark.parametrize("endpoint", ["ftp://x", "not a url", "http://", "gopher://h"])
@pytest.mark.parametrize("command", [["status", "RUN"], ["submit"]])
def test_an_endpoint_that_is_not_an_http_url_is_one_line(endpoint, command):
    env = {"KFP_ENDPOINT": endpoint} if endpoint.startswith("gopher") else None
    args = command if env else [*command, "--endpoint", endpoint]
    code, errors = _invoke(args, env)
    assert code == 1 and errors == [
        f"error: KFP endpoint {endpoint!r} (--endpoint or $KFP_ENDPOINT) is not an http:// or "
        "https:// URL with a host, e.g. https://ds-pipeline-dspa.example.com"
    ]


def test_schedule_blames_the_endpoint_not_the_cron():
    code, errors = _invoke(["schedule", "--endpoint", "ftp://x", "--cron", "30 2 * * *"])
    assert code == 1 and len(errors) == 1 and "KFP endpoint 'ftp://x'" in errors[0]
    assert "--cron" not in errors[0]


@pytest.mark.parametrize(
    ("cron", "named"),
    [
        ("99 99 * * *", "minute '99'"),
        ("0 25 * * *", "hour '25'"),
        ("0 0 32 * *", "day of month '32'"),
        ("0 0 * 13 *", "month '13'"),
        ("0 0 * * 7-1", "day of week '7-1'"),
        ("0 */0 * * *", "step '0'"),
        ("? 0 * * *", "'?' is for the day of month or week only"),
        ("@fortnightly", "not a descriptor"),
    ],
)
def test_schedule_refuses_a_cron_kfp_would_refuse_before_any_request(cron, named):
    """robfig/cron's rules (KFP's ScheduledWorkflow), seconds first; nothing is sent (the
    endpoint answers nothing)."""
    code, errors = _invoke(["schedule", "--endpoint", "http://127.0.0.1:1", "--cron", cron])
    assert code == 2 and len(errors) == 1 and "--cron" in errors[0] and named in errors[0]
    with pytest.raises(CronError, match="KFP's|descriptor"):
        cron_with_seconds(cron)


@pytest.mark.parametrize(
    ("cron", "kfp"),
    [
        ("0 3 * * 1-5", "0 0 3 * * 1-5"),
        ("*/15 * * * *", "0 */15 * * * *"),
        ("0 0 12 ? * MON-FRI", "0 0 12 ? * MON-FRI"),
        ("0 30 2 1,15 jan-jun sun", "0 30 2 1,15 jan-jun sun"),
        ("@daily", "@daily"),
        ("@every 1h30m", "@every 1h30m"),
    ],
)
def test_the_crons_kfp_accepts_still_pass(cron, kfp):
    assert cron_with_seconds(cron) == kfp


@pytest.mark.parametrize("runtime", ["", "../../etc", "UPPER_case!", "a" * 254, "-lead"])
def test_a_runtime_that_is_not_a_kubernetes_name_is_refused_at_compile(runtime, tmp_path):
    out = tmp_path / "p.yaml"
    code, errors = _invoke(["compile", "-o", str(out), "--set", f"cluster.runtime={runtime}"])
    assert code == 2 and len(errors) == 1 and "cluster.runtime" in errors[0], errors
    assert "DNS-1123" in errors[0] and not out.exists()
