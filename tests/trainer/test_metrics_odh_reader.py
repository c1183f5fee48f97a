"""``training_metrics.jsonl`` read with the Open Data Hub Kubeflow SDK's rules (issue #18).

The ODH SDK (opendatahub-io/kubeflow-sdk) injects a progress server into training pods
(``kubeflow/trainer/rhai/instrumentation/traininghub_progression.py``) and writes an
end-of-job message (``traininghub_codegen.py``). This harness re-implements the rules those
files apply to a metrics file — it does not import or copy them — and checks them on the
files a real tiny SFT and GRPO run write, cut at several points mid-run and complete:

- ``lora_sft`` (our SFT): the last line only; progress ``round(100 × step / max_steps)``,
  held at 99 until ``step == max_steps``; ``currentEpoch = max(1, ceil(epoch))``; train loss
  from ``loss``.
- ``lora_grpo`` (our GRPO): the last two lines, merged when they carry the last line's
  ``step``; progress as above; ``ETA = int(wall_time_s / step × (max_steps − step))``, 0 at the
  end; ``currentEpoch = max(1, ceil(epoch))`` of ``totalEpochs = 1``.
- end of job: the last line only; final loss ``loss or train_loss or avg_loss or 0``.

The same runs serve the progress object live (``trainer/progress.py``, ``LINGO_PROGRESS_PORT``):
a thread polls it as the OpenShift AI controller does (``GET /metrics``) while they train, and
every object it got is checked against the file the run wrote, by the ``lora_grpo`` rules
(both SFT and GRPO: the SFT branch has no ETA); the termination message is the final object.
"""

from __future__ import annotations

import json
import math
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo
from trainer.metrics import MetricsWriter, read_metrics
from trainer.progress import EVAL_METRICS, PORT_ENV, TERMINATION_PATH_ENV
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft


def _tail(path: Path, n: int) -> list[dict]:
    """``tail -n N`` then ``json.loads`` per non-blank line, as the reader does."""
    return [json.loads(line) for line in path.read_text().splitlines()[-n:] if line.strip()]


def _percent(step: int, max_steps: int | None) -> int | None:
    if not max_steps:
        return None
    percent = int(round(step / max_steps * 100))
    return min(99, percent) if step < max_steps else min(100, percent)


def _fmt(value, decimals: int = 4) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    number = float(value)
    return f"{number:.{decimals}f}" if math.isfinite(number) else None


def read_lora_sft(path: Path) -> dict:
    """What the SDK's ``lora_sft`` branch reports from a metrics file."""
    m = _tail(path, 1)[-1]
    step, epoch = m.get("step", 0), m.get("epoch", 0)
    return {
        "progressPercentage": _percent(step, m.get("max_steps")),
        "estimatedRemainingSeconds": None,
        "currentStep": step,
        "currentEpoch": max(1, math.ceil(epoch)),
        "totalEpochs": None,
        "loss": _fmt(m.get("loss")),
    }


def read_lora_grpo(path: Path) -> dict:
    """What the SDK's ``lora_grpo`` branch reports from a metrics file."""
    lines = _tail(path, 2)
    last_step = lines[-1].get("step")
    m: dict = {}
    for line in lines:
        if last_step is None or line.get("step") == last_step:
            m.update(line)
    return lora_grpo_object(m)


def lora_grpo_object(m: dict) -> dict:
    """The ``lora_grpo`` branch's object for a (merged) metrics line."""
    step, epoch, max_steps = m.get("step", 0), m.get("epoch", 0), m.get("max_steps")
    wall = m.get("wall_time_s")
    eta = None
    if max_steps and step > 0 and wall and wall > 0:
        eta = int(wall / step * (max_steps - step)) if max_steps > step else 0
    return {
        "progressPercentage": _percent(step, max_steps),
        "estimatedRemainingSeconds": eta,
        "currentStep": step,
        "totalSteps": max_steps or None,
        "currentEpoch": max(1, math.ceil(epoch)),
        "totalEpochs": 1,
        "loss": _fmt(m.get("loss")),
        "trainMetrics": {
            "loss": _fmt(m.get("loss")),
            "learning_rate": _fmt(m.get("learning_rate"), 6),
            "grad_norm": _fmt(m.get("grad_norm")),
            "mean_reward": _fmt(m.get("mean_reward")),
            "full_match_rate": _fmt(m.get("full_match_rate")),
            "entropy": _fmt(m.get("entropy")),
        },
    }


def end_of_job_loss(path: Path) -> str:
    """The final loss the SDK's end-of-job message reports (last line only)."""
    m = json.loads(path.read_text().splitlines()[-1])
    return str(m.get("loss") or m.get("train_loss") or m.get("avg_loss") or 0)


def _cuts(path: Path, tmp: Path) -> list[Path]:
    """The file as a reader sees it after each line was written (every line, then complete)."""
    lines = path.read_text().splitlines(keepends=True)
    out = []
    for n in range(1, len(lines) + 1):
        cut = tmp / f"cut{n}" / path.name
        cut.parent.mkdir(parents=True)
        cut.write_text("".join(lines[:n]))
        out.append(cut)
    return out


def _check(path: Path, tmp: Path, reader, planned_epochs: int) -> None:
    lines = read_metrics(path)
    steps = [m for m in lines if m["step"] > 0]
    # one line per optimizer step (GRPO adds its step-0 baseline first)
    assert [m["step"] for m in steps] == list(range(1, lines[-1]["max_steps"] + 1))
    end = lines[-1]["wall_time_s"]
    previous, wall_so_far = -1, 0.0
    for cut in _cuts(path, tmp):
        seen, last = reader(cut), read_metrics(cut)[-1]
        assert seen["progressPercentage"] >= previous
        previous = seen["progressPercentage"]
        assert seen["currentEpoch"] <= (seen["totalEpochs"] or planned_epochs), seen
        if last["step"] == 0:
            assert seen["progressPercentage"] == 0
            continue
        # a train loss at every step, eval steps included
        assert seen["loss"] == _fmt(last["loss"]) and seen["loss"] is not None, (cut, seen)
        if last["step"] < last["max_steps"]:
            assert seen["progressPercentage"] < 100
            eta = seen["estimatedRemainingSeconds"]
            if eta is not None:  # GRPO branch
                # the reader's estimate is the mean time per step so far times the steps
                # left: it can only be right if wall_time_s is the run's cumulative time at
                # this step (checked from the file itself: a bound against this machine's
                # clock failed whenever a loaded machine slowed one step)
                assert last["wall_time_s"] >= wall_so_far and last["wall_time_s"] <= end
                mean_step = last["wall_time_s"] / last["step"]
                assert eta == int(mean_step * (last["max_steps"] - last["step"])), (seen, last)
        wall_so_far = max(wall_so_far, last.get("wall_time_s") or 0.0)
    final = reader(path)
    assert final["progressPercentage"] == 100
    assert final["estimatedRemainingSeconds"] in (0, None)
    # the last line is a train line: the end-of-job loss is the last train loss (GRPO's is
    # exactly 0.0 on a step where no group had signal, which the reader writes as "0")
    assert lines[-1]["loss"] is not None
    assert float(end_of_job_loss(path)) == lines[-1]["loss"]


class ProgressPoller:
    """GET ``/metrics`` every 20 ms from a thread, as the OpenShift AI controller polls the
    training pod (every 5-300 s there); keeps every object answered."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.objects: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    assert answer.headers["Content-Type"] == "application/json"
                    self.objects.append(json.loads(answer.read()))
            except OSError:  # not serving yet (loading), or no longer
                pass
            time.sleep(0.02)

    def __enter__(self) -> ProgressPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def progress_env(tmp_path, monkeypatch):
    """Progress tracking on (a free port), a termination message file as the kubelet mounts."""
    port = free_port()
    termination = tmp_path / "termination-log"
    termination.touch()
    monkeypatch.setenv(PORT_ENV, str(port))
    monkeypatch.setenv(TERMINATION_PATH_ENV, str(termination))
    return port, termination


def _latest_eval(lines: list[dict], step: int, inclusive: bool) -> dict:
    out: dict = {}
    for m in lines:
        if m["step"] < step or (inclusive and m["step"] == step):
            out |= {k: _fmt(m[k]) for k in EVAL_METRICS if m.get(k) is not None}
    return out


def _check_served(
    objects: list[dict], path: Path, termination: Path, port: int, total_epochs: int
) -> None:
    """Every polled object against the file the run wrote, by the ``lora_grpo`` rules."""
    lines = read_metrics(path)
    by_step = {m["step"]: m for m in lines}
    max_steps = lines[-1]["max_steps"]
    served = [o for o in objects if o["progressPercentage"] is not None]
    # seen while training, not only at the end
    assert len({o["currentStep"] for o in served}) >= 3, [o["currentStep"] for o in objects]
    assert any(o["currentStep"] < max_steps for o in served)
    percents = [o["progressPercentage"] for o in served]
    assert percents == sorted(percents) and percents[-1] == 100
    for o in objects:
        assert set(o) == {
            "progressPercentage",
            "estimatedRemainingSeconds",
            "currentStep",
            "totalSteps",
            "currentEpoch",
            "totalEpochs",
            "trainMetrics",
            "evalMetrics",
        }
        assert isinstance(o["currentEpoch"], float)
        if o["progressPercentage"] is None:  # before the first line
            assert o["currentStep"] == 0 and o["totalSteps"] is None
            continue
        assert o["totalEpochs"] == total_epochs
        step = o["currentStep"]
        expected = lora_grpo_object(by_step[step])
        for key in ("progressPercentage", "currentStep", "totalSteps", "currentEpoch"):
            assert o[key] == expected[key], (key, o, by_step[step])
        # the train figures the line carries, as the reader formats them (loss: every step)
        train = o["trainMetrics"]
        assert train == {k: expected["trainMetrics"][k] for k in train}, (o, by_step[step])
        if step > 0:
            assert train["loss"] == _fmt(by_step[step]["loss"]) is not None
            assert {"loss", "learning_rate", "grad_norm"} <= set(train)
        # ETA: the reader's formula on the line as it stood when polled: written at the step
        # (after the previous line) or rewritten with the step's eval (the file's last word)
        if step == 0:
            assert o["estimatedRemainingSeconds"] is None
        else:
            earliest = lora_grpo_object({**by_step[step], "wall_time_s": _wall_before(lines, step)})
            eta_bounds = (
                earliest["estimatedRemainingSeconds"] or 0,  # None: nothing before step 1
                expected["estimatedRemainingSeconds"],
            )
            assert eta_bounds[0] <= o["estimatedRemainingSeconds"] <= eta_bounds[1], (o, eta_bounds)
        # the latest held-out figures: this step's, or the eval before it when polled between
        assert o["evalMetrics"] in (
            _latest_eval(lines, step, True),
            _latest_eval(lines, step, False),
        ), o
    final = json.loads(termination.read_text())
    assert final == served[-1]
    assert final["progressPercentage"] == 100 and final["estimatedRemainingSeconds"] == 0
    assert final["trainMetrics"]["loss"] == _fmt(lines[-1]["loss"])
    assert final["evalMetrics"] == _latest_eval(lines, max_steps, True) != {}
    assert len(termination.read_bytes()) < 4096  # Kubernetes keeps 4096 bytes of it
    with pytest.raises(OSError):  # stopped with the run: the port is free again
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _wall_before(lines: list[dict], step: int) -> float:
    return max([m["wall_time_s"] for m in lines if m["step"] < step], default=0.0)


@pytest.fixture(scope="module")
def small_data(prepared_data, tmp_path_factory):
    """A train split of 12 rows, so a few steps make more than one pass over the data."""
    out = tmp_path_factory.mktemp("small")
    rows = (prepared_data / "train.jsonl").read_text().splitlines(keepends=True)
    (out / "train.jsonl").write_text("".join(rows[:12]))
    (out / "eval.jsonl").write_text((prepared_data / "eval.jsonl").read_text())
    return out


def _run_polled(recipe, cfg, model_dir, data: Path, tmp_path: Path, progress_env):
    """Run ``recipe`` (``run_sft`` / ``run_grpo``) while polling its progress server."""
    with ProgressPoller(progress_env[0]) as poller:
        result = recipe(
            cfg,
            model_dir,
            data / "train.jsonl",
            data / "eval.jsonl",
            tmp_path / "model",
            tmp_path / "work",
        )
    return result, poller.objects


def test_sft_metrics_read_right_by_the_odh_reader_and_served_live(
    tmp_path, tiny_model_dir, small_data, progress_env
):
    cfg = SFTConfig(
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        max_seq_len=512,
        merge_check_prompts=1,
        eval_max_examples=4,
        max_steps=7,  # 3 steps per pass over 12 rows: 2.33 passes
        eval_every=3,
    )
    result, served = _run_polled(run_sft, cfg, tiny_model_dir, small_data, tmp_path, progress_env)
    path = Path(result.metrics_file)
    lines = read_metrics(path)
    assert lines[-1]["data_passes"] > 2 and lines[-1]["epoch"] == 1.0
    assert [m["step"] for m in lines if "eval_loss" in m] == [3, 6, 7]
    _check(path, tmp_path / "cuts", read_lora_sft, planned_epochs=1)
    _check(path, tmp_path / "cuts-grpo-rules", read_lora_grpo, planned_epochs=1)
    assert end_of_job_loss(path) == str(result.last_loss) != "0"
    _check_served(served, path, progress_env[1], progress_env[0], total_epochs=1)


def test_grpo_metrics_read_right_by_the_odh_reader_and_served_live(
    tmp_path, tiny_model_dir, small_data, progress_env
):
    cfg = GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": 4, "max_new_tokens": 8},
            "prompts_per_step": 4,
            "mini_batch_size": 16,
            "micro_batch_size": 8,
            "max_steps": 4,  # 16 prompts drawn from 12: more than one pass
            "eval_every": 2,
            "eval_prompts": 2,
            "eval_samples": 1,
            "optim": {"learning_rate": 1e-3, "lr_scheduler": "constant"},
            "dtype": "float32",
        }
    )
    result, served = _run_polled(run_grpo, cfg, tiny_model_dir, small_data, tmp_path, progress_env)
    path = Path(result.metrics_file)
    lines = read_metrics(path)
    assert lines[-1]["data_passes"] > 1 and lines[-1]["epoch"] == 1.0
    assert [m["step"] for m in lines if "eval_mean_reward" in m] == [0, 2, 4]
    _check(path, tmp_path / "cuts", read_lora_grpo, planned_epochs=1)
    # every train line carries full_match_rate (both languages right), which the reader shows
    for m in lines[1:]:
        assert (
            0.0
            <= m["full_match_rate"]
            <= min(m["answer_language_accuracy"], m["reasoning_language_accuracy"])
        )
    assert read_lora_grpo(path)["trainMetrics"]["full_match_rate"] is not None
    _check_served(served, path, progress_env[1], progress_env[0], total_epochs=1)


def test_eval_values_merge_onto_the_step_line_and_survive_a_resume(tmp_path):
    path = tmp_path / "training_metrics.jsonl"
    writer = MetricsWriter(path, max_steps=4, planned_epochs=2.0)
    writer.log(1, loss=2.0)
    writer.log(2, loss=1.5)
    writer.log(2, eval_loss=1.7, bad=float("nan"))
    lines = read_metrics(path)
    assert [m["step"] for m in lines] == [1, 2]
    assert lines[-1]["loss"] == 1.5 and lines[-1]["eval_loss"] == 1.7 and lines[-1]["bad"] is None
    assert [m["epoch"] for m in lines] == [0.5, 1.0]  # planned epochs completed, 0 … 2
    writer.log(3, loss=1.2)  # then killed; the checkpoint holds step 2
    resumed = MetricsWriter(path, max_steps=4, planned_epochs=2.0, resume_step=2)
    assert [m["step"] for m in read_metrics(path)] == [1, 2]
    resumed.log(3, loss=1.1)
    resumed.log(4, loss=1.0)
    resumed.log(4, eval_loss=1.3)
    lines = read_metrics(path)
    assert [(m["step"], m["loss"]) for m in lines] == [(1, 2.0), (2, 1.5), (3, 1.1), (4, 1.0)]
    assert lines[1]["eval_loss"] == 1.7 and lines[-1]["epoch"] == 2.0
    assert end_of_job_loss(path) == "1.0"
