"""Eval engines: HF generate on the tiny GPT-OSS, and the OpenAI-compatible endpoint client
against real HTTP servers started here (one serving the tiny model, one scripted with faults)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
import torch
from chat_server import Reply, chat_server, completion

from core.harmony import render_prompt, stop_token_ids
from core.modeling import load_causal_lm, load_tokenizer
from core.parsing import parse_response
from core.seeds import sample_seed
from eval.engines import make_engine
from eval.eval_config import DEFAULT_PERSONA, EndpointSettings, EvalConfig, SamplingSettings
from eval.report import load_results
from eval.runner import build_requests, load_questions, question_prompt, run_eval
from generation.endpoint import ChatEndpointEngine, EndpointError, api_base
from generation.engines import HFEngine, ModelNotFoundError
from generation.requests import GenerationRequest
from generation.vllm import vllm_sampling_kwargs
from trainer.tiny_model import SMALLEST, build_tiny_model

SMALL = SMALLEST
GREEDY = SamplingSettings(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", SMALL)


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, device="cpu", batch_size=5)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def requests_5():
    return [r for _, _, r in build_requests(load_questions(limit=5), EvalConfig())]


# -- Hugging Face engine ---------------------------------------------------------------------


def test_hf_batches_with_left_padding_like_single_prompts(hf_engine, requests_5):
    prompts = requests_5[:3]
    assert len({len(r.prompt) for r in prompts}) == 3  # prompts of different lengths
    batched = hf_engine.generate(prompts, GREEDY)
    hf_engine.batch_size = 1
    try:
        single = hf_engine.generate(prompts, GREEDY)
    finally:
        hf_engine.batch_size = 5
    assert [g.text for g in batched] == [g.text for g in single]
    assert all(g.finish_reason in ("stop", "length") for g in batched)
    assert all(0 < g.completion_tokens <= GREEDY.max_tokens for g in batched)


def test_hf_same_seed_same_samples(hf_engine, requests_5):
    sampling = SamplingSettings(max_tokens=6, seed=3)
    first = [g.text for g in hf_engine.generate(requests_5, sampling)]
    second = [g.text for g in hf_engine.generate(requests_5, sampling)]
    assert first == second


def _with_seed(request: GenerationRequest, seed: int, key: str) -> GenerationRequest:
    return GenerationRequest(key, request.prompt, request.messages, seed)


def test_hf_each_request_draws_its_own_stream(hf_engine, requests_5):
    """The same prompt twice in one batch gives two samples; a request alone or in another
    batch gives what it gave in the first; the same seeds give the same samples again."""
    sampling = SamplingSettings(max_tokens=8, temperature=1.0)
    prompt = requests_5[0]
    twins = [_with_seed(prompt, seed, f"q#{seed}") for seed in (11, 12, 13, 14)]
    texts = [g.text for g in hf_engine.generate(twins, sampling)]
    assert len(set(texts)) == 4, texts
    assert [g.text for g in hf_engine.generate(twins, sampling)] == texts
    mixed = [twins[2], *requests_5[1:], twins[0]]
    again = [g.text for g in hf_engine.generate(mixed, sampling)]
    assert (again[0], again[-1]) == (texts[2], texts[0])
    alone = hf_engine.generate([twins[1]], sampling)[0].text
    assert alone == texts[1]


def test_eval_requests_have_distinct_seeds_and_first_tokens_vary(hf_engine):
    """Eval seeds are per (question, sample): never shared, reproducible; the first tokens
    of sample k across questions are not one shared draw."""
    config = EvalConfig(sampling=SamplingSettings(n=3, seed=5, temperature=1.0, max_tokens=1))
    built = build_requests(load_questions(limit=8), config)
    seeds = [r.seed for _, _, r in built]
    assert len(set(seeds)) == len(seeds) == 24
    assert seeds == [r.seed for _, _, r in build_requests(load_questions(limit=8), config)]
    # per request, what VLLMGenerator.complete gives vLLM (the eval keeps the stop text)
    params = [
        vllm_sampling_kwargs(config.sampling, r.seed, [7], stop_text=True) for _, _, r in built
    ]
    assert [p["seed"] for p in params] == seeds and {p["n"] for p in params} == {1}
    first = [g.text for g in hf_engine.generate([r for _, _, r in built], config.sampling)]
    for sample in range(3):
        of_sample = [t for (_, k, _), t in zip(built, first, strict=True) if k == sample]
        assert len(set(of_sample)) >= 4, of_sample


def _force_token(engine: HFEngine, token: str) -> None:
    """Make the model emit ``token`` at every step (a head with zero weights and one bias)."""
    hidden = engine.model.config.hidden_size
    vocab = engine.model.config.vocab_size
    head = torch.nn.Linear(hidden, vocab, bias=True)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    head.bias.data[engine.tokenizer.convert_tokens_to_ids(token)] = 10.0
    engine.model.lm_head = head


def test_hf_keeps_special_tokens_and_stops_at_return(tiny_model_dir, requests_5):
    engine = HFEngine(tiny_model_dir, device="cpu", batch_size=5)
    try:
        _force_token(engine, "<|channel|>")
        looped = engine.generate(requests_5[:2], GREEDY)
        assert [g.text for g in looped] == ["<|channel|>" * GREEDY.max_tokens] * 2
        assert {g.finish_reason for g in looped} == {"length"}
        _force_token(engine, "<|return|>")
        stopped = engine.generate(requests_5[:2], GREEDY)
        assert [(g.text, g.finish_reason, g.completion_tokens) for g in stopped] == [
            ("<|return|>", "stop", 1)
        ] * 2
    finally:
        engine.close()


def test_missing_or_invalid_model_directory(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        make_engine(str(tmp_path / "absent"), EvalConfig())
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        make_engine(str(tmp_path / "empty"), EvalConfig())


# -- a real OpenAI-compatible HTTP server ----------------------------------------------------


class TinyModelApp:
    """``/v1/chat/completions`` backed by the tiny model: chat template, sampling, harmony
    decode, then the reasoning split off into ``reasoning_content`` as vLLM's parser does."""

    def __init__(self, model_dir) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_causal_lm(model_dir, torch.float32)
        self.stop = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
        self.lock = threading.Lock()
        self.rendered: list[tuple[list[dict], str]] = []

    def __call__(self, body: dict) -> Reply:
        prompt = self.tokenizer.apply_chat_template(
            body["messages"], add_generation_prompt=True, tokenize=False
        )
        encoded = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
        with self.lock, torch.inference_mode():
            self.rendered.append((body["messages"], prompt))
            torch.manual_seed(body["seed"])
            output = self.model.generate(
                **encoded,
                max_new_tokens=body["max_tokens"],
                do_sample=True,
                temperature=body["temperature"],
                top_p=body["top_p"],
                eos_token_id=self.stop,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = output[0, encoded["input_ids"].shape[1] :].tolist()
        text = self.tokenizer.decode(new, skip_special_tokens=False)
        parsed = parse_response(text)
        finish = "stop" if new and new[-1] in self.stop else "length"
        message = {"content": parsed.final or "", "reasoning_content": parsed.reasoning}
        return 200, completion(message, finish), {}, 0.0


def test_endpoint_engine_against_a_server_of_the_tiny_model(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LINGO_TEST_API_KEY", "s3cret")
    app = TinyModelApp(tiny_model_dir)
    config = EvalConfig(
        limit=5,
        sampling=SamplingSettings(max_tokens=16, seed=11),
        endpoint=EndpointSettings(api_key_env="LINGO_TEST_API_KEY", concurrency=2),
    )
    with chat_server(app, ["tiny-gpt-oss"]) as server:
        url = f"http://127.0.0.1:{server.server_port}"
        started = time.perf_counter()
        run_eval([f"tiny={url}"], config, tmp_path)
        seconds = time.perf_counter() - started
    data = load_results(tmp_path)
    assert data["models"][0]["engine"] == f"endpoint:{url}/v1 (model tiny-gpt-oss)"
    assert len(data["responses"]) == 5
    assert not any(r["error"] for r in data["responses"])
    assert all(r["score"] is not None for r in data["responses"])
    assert {b["model"] for b in server.bodies} == {"tiny-gpt-oss"}
    assert {(b["temperature"], b["top_p"], b["max_tokens"]) for b in server.bodies} == {
        (0.7, 0.95, 16)
    }
    # one seed per question (and sample), from the run's seed 11: never shared
    assert sorted(b["seed"] for b in server.bodies) == sorted(
        sample_seed(11, "eval", q.id, 0) for q in load_questions(limit=5)
    )
    assert set(server.auth) == {"Bearer s3cret"}
    assert server.max_in_flight <= 2
    # the server's chat template renders exactly the prompt the HF engine uses (training form)
    questions = {q.question: q for q in load_questions(limit=5)}
    assert len(app.rendered) == 5
    for (system, user), prompt in app.rendered:
        instructions, _ = question_prompt(questions[user["content"]], EvalConfig())
        assert DEFAULT_PERSONA in instructions
        assert system == {"role": "system", "content": instructions}
        assert prompt == render_prompt(system["content"], user["content"], "medium")
    assert seconds < 30


# -- faults: timeouts, 5xx, 429, 4xx, malformed and empty bodies -----------------------------

REASONING_FR = "Je calcule trente-cinq pour cent de quatre cent quatre-vingts élèves de l'école."
FINAL_FR = "Ils sont 168 élèves à aller à l'école à pied."


def scripted_faults(questions) -> Callable[[dict], Reply]:
    """A reply per question (by its text): the forms gpt-oss servers answer in, and faults."""
    ids = {q.question: q.id for q in questions}
    calls: dict[str, int] = {}
    lock = threading.Lock()
    harmony = (
        f"<|channel|>analysis<|message|>{REASONING_FR}<|end|>"
        f"<|start|>assistant<|channel|>final<|message|>{FINAL_FR}<|return|>"
    )

    def reply(body: dict) -> Reply:
        qid = ids[body["messages"][1]["content"]]
        with lock:
            calls[qid] = calls.get(qid, 0) + 1
            n = calls[qid]
        ok_split = completion({"content": FINAL_FR, "reasoning_content": REASONING_FR})
        table: dict[str, Reply] = {
            "p01-en": (200, ok_split, {}, 0.0),
            "p01-fr": (200, completion({"content": FINAL_FR, "reasoning": REASONING_FR}), {}, 0.0),
            "p01-de": (200, completion({"content": harmony}), {}, 0.0),
            "p01-es": (500, {"error": "flaky"}, {}, 0.0) if n == 1 else (200, ok_split, {}, 0.0),
            "p01-it": (500, {"error": "down"}, {}, 0.0),
            "p02-en": (200, ok_split, {}, 2.0),  # always slower than the client timeout
            "p02-fr": (429, {"error": "slow down"}, {"Retry-After": "0"}, 0.0)
            if n == 1
            else (200, ok_split, {}, 0.0),
            "p02-de": (400, {"error": "bad request"}, {}, 0.0),
            "p02-es": (200, completion({"content": ""}), {}, 0.0),
            "p02-it": (200, "this is not json", {}, 0.0),
        }
        return table[qid]

    return reply


def test_endpoint_retries_then_records_failures(tmp_path):
    questions = load_questions(limit=10)
    settings = EndpointSettings(timeout_s=0.5, max_retries=2, backoff_s=0.01, concurrency=4)
    with chat_server(scripted_faults(questions), ["a", "b"]) as server:
        url = f"http://127.0.0.1:{server.server_port}/v1/"
        with pytest.raises(EndpointError, match="serves 2 models"):
            ChatEndpointEngine(url, None, settings)
        engine = ChatEndpointEngine(url, "a", settings)
        planned = build_requests(questions, EvalConfig())
        generations = engine.generate([r for _, _, r in planned], SamplingSettings())
    by_id = {q.id: g for (q, _, _), g in zip(planned, generations, strict=True)}

    for qid in ("p01-en", "p01-fr", "p01-de"):  # reasoning_content, reasoning, inline harmony
        parsed = by_id[qid].parsed()
        assert (parsed.reasoning, parsed.final) == (REASONING_FR, FINAL_FR), qid
        assert by_id[qid].attempts == 1
    assert (by_id["p01-es"].error, by_id["p01-es"].attempts) == (None, 2)  # 500 once, then ok
    assert by_id["p01-it"].attempts == 3 and by_id["p01-it"].error.startswith("HTTP 500")
    assert by_id["p02-en"].attempts == 3 and "Timeout" in by_id["p02-en"].error
    assert (by_id["p02-fr"].error, by_id["p02-fr"].attempts) == (None, 2)  # 429, Retry-After
    assert by_id["p02-de"].attempts == 1 and by_id["p02-de"].error.startswith("HTTP 400")
    assert by_id["p02-it"].attempts == 1 and "malformed" in by_id["p02-it"].error
    empty = by_id["p02-es"]  # an empty answer is a model outcome, not a failure
    assert empty.error is None and empty.parsed().final is None


def test_endpoint_failures_past_the_threshold_fail_the_run(tmp_path):
    questions = load_questions(limit=10)
    config = EvalConfig(
        limit=10,
        max_failure_fraction=0.3,
        endpoint=EndpointSettings(timeout_s=0.5, max_retries=1, backoff_s=0.01, concurrency=4),
    )
    with chat_server(scripted_faults(questions), ["only"]) as server:
        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(RuntimeError, match=r"4/10 responses failed \(40% > 30%\)"):
            run_eval([f"served={url}"], config, tmp_path)
    failed = {r["id"]: r["error"] for r in load_results(tmp_path)["responses"] if r["error"]}
    assert set(failed) == {"p01-it", "p02-en", "p02-de", "p02-it"}


def test_api_base_forms():
    assert api_base("http://h:8000") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert api_base("https://h/serving/v1/chat/completions") == "https://h/serving/v1"
    assert api_base("https://h/serving/v1/completions/") == "https://h/serving/v1"


# -- /v1/completions: the prompt rendered here (lingo eval --api completions) ----------------


class TinyCompletionsApp:
    """vLLM's ``/v1/completions`` backed by the tiny model, with vLLM's defaults for its extra
    parameters: the prompt text tokenized with the model's tokenizer (``add_special_tokens``,
    default true), greedy decoding to the model's stop tokens, the text decoded with special
    tokens skipped unless ``skip_special_tokens`` is false and the stop token's text dropped
    unless ``include_stop_str_in_output`` is true."""

    def __init__(self, model_dir) -> None:
        self.tokenizer = load_tokenizer(model_dir)
        self.model = load_causal_lm(model_dir, torch.float32)
        self.stop = stop_token_ids(self.tokenizer, self.model.generation_config)
        self.lock = threading.Lock()

    def __call__(self, body: dict) -> Reply:
        if body["temperature"] != 0:
            return 400, {"error": "this test server decodes greedily only"}, {}, 0.0
        encoded = self.tokenizer(
            body["prompt"],
            add_special_tokens=body.get("add_special_tokens", True),
            return_tensors="pt",
        )
        with self.lock, torch.inference_mode():
            output = self.model.generate(
                **encoded,
                max_new_tokens=body["max_tokens"],
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=self.stop,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new = output[0, encoded["input_ids"].shape[1] :].tolist()
        stopped = bool(new) and new[-1] in self.stop
        kept = new[:-1] if stopped and not body.get("include_stop_str_in_output") else new
        text = self.tokenizer.decode(
            kept, skip_special_tokens=body.get("skip_special_tokens", True)
        )
        choice = {"index": 0, "text": text, "finish_reason": "stop" if stopped else "length"}
        reply = {"object": "text_completion", "choices": [choice]}
        return 200, reply | {"usage": {"completion_tokens": len(new)}}, {}, 0.0


@pytest.fixture(scope="module")
def special_tokens_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with the output rows of ``<|channel|>``, ``<|message|>`` and
    ``<|return|>`` tripled: its greedy responses hold harmony tokens and most stop."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("special") / "model")
    weights = load_file(path / "model.safetensors")
    ids = load_tokenizer(path).convert_tokens_to_ids(["<|channel|>", "<|message|>", "<|return|>"])
    weights["lm_head.weight"][ids] *= 3.0
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_lingo_eval_api_completions_scores_what_the_hf_engine_scores(
    special_tokens_model_dir, tmp_path
):
    """``--api completions`` sends the harmony prompt the HF engine encodes and parses the
    reply's text (special tokens and the stop token kept) as the HF engine's: greedy, the
    same text, channels and scores, response for response."""
    from typer.testing import CliRunner

    from pipelines.cli import app as cli

    model = special_tokens_model_dir
    with chat_server(TinyCompletionsApp(model), ["tiny"]) as server:
        url = f"http://127.0.0.1:{server.server_port}/v1"
        options = ["--temperature", "0", "--max-tokens", "24", "--limit", "5"]
        result = CliRunner().invoke(
            cli,
            ["eval", "-m", f"local={model}", "-m", f"served={url}#tiny", "--api", "completions",
             *options, "-o", str(tmp_path)],
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert set(server.paths) == {"/v1/completions"}
    planned = build_requests(load_questions(limit=5), EvalConfig())
    assert sorted(b["prompt"] for b in server.bodies) == sorted(r.prompt for _, _, r in planned)
    for body in server.bodies:
        assert (body["add_special_tokens"], body["skip_special_tokens"]) == (False, False)
        assert body["include_stop_str_in_output"] is True and body["n"] == 1
    data = load_results(tmp_path)
    assert data["models"][1]["engine"] == f"endpoint:{url}/completions (model tiny)"
    local = {r["id"]: r for r in data["responses"] if r["model"] == "local"}
    served = {r["id"]: r for r in data["responses"] if r["model"] == "served"}
    assert len(local) == 5 and served.keys() == local.keys()
    for key, ours in local.items():
        theirs = served[key]
        assert theirs["error"] is None and theirs["text"] == ours["text"], key
        assert (theirs["reasoning"], theirs["final"]) == (ours["reasoning"], ours["final"]), key
        assert theirs["score"] == ours["score"] and theirs["finish_reason"] == ours["finish_reason"]
    # what is compared holds harmony tokens and responses that stopped on <|return|>
    assert all("<|message|>" in r["text"] for r in local.values())
    assert any(r["text"].endswith("<|return|>") for r in local.values())


@pytest.mark.parametrize(
    "body, error",
    [
        ({"choices": [{"text": 7}]}, "'choices[0].text' is a int, not a string"),
        ({"choices": [{"text": "a"}, {"text": "b"}]}, "'choices' holds 2 choices"),
        (completion({"content": "a chat reply"}), "KeyError: 'text'"),
    ],
)
def test_a_completion_reply_that_is_not_one_text_is_that_responses_failure(body, error):
    (request,) = [r for _, _, r in build_requests(load_questions(limit=1), EvalConfig())]
    config = EvalConfig(endpoint=EndpointSettings(api="completions", max_retries=0))
    with chat_server(lambda _: (200, body, {}, 0.0), ["m"]) as server:
        engine = make_engine(f"http://127.0.0.1:{server.server_port}", config, "m")
        (generation,) = engine.generate([request], SamplingSettings())
    assert generation.error.startswith("malformed response") and error in generation.error


@pytest.mark.gpu
def test_vllm_engine_on_the_tiny_model(tmp_path):
    """vLLM needs CUDA (and head_dim >= 64): a GPU-only check of the same convention."""
    pytest.importorskip("vllm")
    model_dir = build_tiny_model(tmp_path / "model", SMALL.model_copy(update={"head_dim": 64}))
    config = EvalConfig(engine="vllm", limit=5, sampling=SamplingSettings(max_tokens=16))
    engine = make_engine(str(model_dir), config)
    try:
        requests_ = [r for _, _, r in build_requests(load_questions(limit=5), config)]
        generations = engine.generate(requests_, config.sampling)
    finally:
        engine.close()
    assert len(generations) == 5
    assert all(g.error is None and g.finish_reason in ("stop", "length") for g in generations)


def test_run_eval_cli_on_a_model_directory(tiny_model_dir, tmp_path):
    from eval.cli import run_eval_cli

    report = run_eval_cli(
        [f"tiny={tiny_model_dir}"], tmp_path, max_tokens=4, limit=2, device="cpu", seed=1
    )
    assert report == tmp_path / "report.md"
    data = load_results(tmp_path)
    assert data["sampling"] == {
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": 4,
        "seed": 1,
        "n": 1,
    }
    assert [r["id"] for r in data["responses"]] == ["p01-en", "p01-fr"]
    assert all(r["completion_tokens"] <= 4 for r in data["responses"])


def test_every_model_location_is_checked_before_any_generation(tiny_model_dir, tmp_path):
    from eval.cli import run_eval_cli

    models = [f"good={tiny_model_dir}", f"gone={tmp_path / 'nope'}", f"empty={tmp_path}"]
    with pytest.raises(ModelNotFoundError) as err:
        run_eval_cli(models, tmp_path / "out", max_tokens=4, limit=1, device="cpu")
    assert "gone: model directory" in str(err.value) and "empty: " in str(err.value)
    assert not (tmp_path / "out").exists()  # nothing generated for "good" first


def test_a_model_that_fails_to_load_keeps_the_finished_models_results(tiny_model_dir, tmp_path):
    # issue #17: on main "good"'s finished results were thrown away when "bad" failed to load
    import shutil

    from eval.cli import run_eval_cli
    from eval.runner import ModelEvalError

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    # readable files (the pre-check passes) whose weights do not fit the config: a load error
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    with pytest.raises(ModelEvalError, match=rf"model 'bad' \({bad}\) failed") as err:
        run_eval_cli(
            [f"good={tiny_model_dir}", f"bad={bad}"],
            tmp_path / "out",
            max_tokens=4,
            limit=1,
            device="cpu",
        )
    assert "(good) are in" in str(err.value) and "model.safetensors" in str(err.value)
    data = load_results(tmp_path / "out")
    assert [m["label"] for m in data["models"]] == ["good"]
    assert len(data["responses"]) == 1


def test_the_pre_check_names_missing_tokenizer_files_and_damaged_weights(tiny_model_dir, tmp_path):
    # issue #32 item 13: without tokenizer.json the pre-check passed and the eval failed later
    # with "install sentencepiece or tiktoken"
    import shutil

    from eval.cli import run_eval_cli

    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    torn = tmp_path / "torn"
    shutil.copytree(tiny_model_dir, torn)
    (torn / "model.safetensors").write_bytes(b"\x00" * 64)
    models = [f"a={no_tokenizer}", f"b={torn}"]
    with pytest.raises(ModelNotFoundError) as err:
        run_eval_cli(models, tmp_path / "out", max_tokens=4, limit=1, device="cpu")
    message = str(err.value)
    assert f"a: {no_tokenizer} has no tokenizer files (tokenizer.json or" in message
    assert f"b: {torn / 'model.safetensors'} is not a readable safetensors file" in message
    assert not (tmp_path / "out").exists()


def test_non_finite_weights_stop_the_eval_before_any_generation(tiny_model_dir, tmp_path):
    # issue #32 item 9: on main a model with NaN weights was scored as a real model, exit 0
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from eval.cli import run_eval_cli
    from eval.runner import NonFiniteWeightsError

    nan = tmp_path / "nan"
    shutil.copytree(tiny_model_dir, nan)
    weights = load_file(nan / "model.safetensors")
    name = sorted(weights)[3]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, nan / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteWeightsError, match=rf"nan: {nan / 'model.safetensors'}: {name}"):
        run_eval_cli(
            [f"good={tiny_model_dir}", f"nan={nan}"], tmp_path / "out", limit=1, device="cpu"
        )
    assert not (tmp_path / "out").exists()
