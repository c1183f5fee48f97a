"""A step's config class is its component's inputs and the pipeline's parameters (issue #22):
a field added to the class reaches the compiled pipeline and the component with no other edit.
"""

import importlib
import inspect
import json
from typing import Annotated, Literal

import pytest
import yaml
from kfp import compiler, dsl, local
from pydantic import BaseModel, Field

import data_prep.config
from components.config_fields import (
    UnsupportedFieldError,
    config_arguments,
    parameter_type,
    with_config_fields,
    with_config_parameters,
)
from core.config_model import ConfigModel
from data_prep.config import DataPrepConfig

pytestmark = pytest.mark.filterwarnings("ignore:.*custom or non-Python base image")


class Nested(ConfigModel):
    depth: int = 2


class ToyConfig(ConfigModel):
    name: str = "toy"
    count: int = 3
    ratio: float = 0.5
    enabled: bool = True
    mode: Literal["fast", "slow"] = "fast"
    tags: list[str] = Field(default_factory=lambda: ["a"])
    extra: dict[str, str] = Field(default_factory=dict)
    nested: Nested = Nested()
    factor: Annotated[int, Field(ge=0)] | Literal["auto"] = "auto"
    label: str | None = None


@dsl.component(base_image="python:3.11", install_kfp_package=False)
@with_config_fields(ToyConfig)
def echo_config(config: dict, suffix: str = "") -> str:
    """Returns the fields it was given, as JSON."""
    import json

    return json.dumps(config, sort_keys=True) + suffix


@dsl.pipeline
@with_config_parameters(ToyConfig(), prefix="toy_", param="toy")
def toy_pipeline(toy: dict, suffix: str = "!") -> str:
    return echo_config(**toy, suffix=suffix).output


def test_field_types_map_to_kfp_parameter_types():
    kinds = {name: parameter_type(ToyConfig, name) for name in ToyConfig.model_fields}
    assert kinds == {
        "name": (str, False),
        "count": (int, False),
        "ratio": (float, False),
        "enabled": (bool, False),
        "mode": (str, False),
        "tags": (list, False),
        "extra": (dict, False),
        "nested": (dict, False),
        "label": (str, True),
        "factor": (str, False),  # a number or "auto": the parameter carries the text
    }


def test_a_field_kfp_cannot_carry_is_named_in_the_error():
    class Odd(BaseModel):
        either: int | list[int] = 1

    with pytest.raises(UnsupportedFieldError, match=r"Odd\.either: .*int \| list\[int\]"):
        parameter_type(Odd, "either")

    def template(config: dict) -> str:
        return ""

    with pytest.raises(UnsupportedFieldError, match=r"Odd\.either"):
        with_config_fields(Odd)(template)


def test_a_field_named_like_another_parameter_is_refused():
    class Clash(BaseModel):
        suffix: str = ""

    def template(config: dict, suffix: str = "") -> str:
        return ""

    with pytest.raises(ValueError, match=r"Clash field\(s\) \['suffix'\]"):
        with_config_fields(Clash)(template)

    def no_config(settings: dict) -> str:
        return ""

    with pytest.raises(ValueError, match=r"no parameter 'config' without a default"):
        with_config_fields(ToyConfig)(no_config)


def test_the_component_takes_one_input_per_field_in_the_shipped_source():
    params = inspect.signature(echo_config.python_func).parameters
    assert list(params) == [*ToyConfig.model_fields, "suffix"]  # `label` (optional) last
    assert params["label"].default is None and params["count"].annotation is int
    inputs = echo_config.component_spec.inputs
    assert inputs["count"].type == "Integer" and inputs["nested"].type == "Dict"
    assert inputs["label"].optional and not inputs["count"].optional
    source = echo_config.component_spec.implementation.container.command[-1]
    assert "def echo_config(name: str, count: int, ratio: float" in source
    assert "config = dict(name=name, count=count" in source


def test_the_pipeline_takes_one_parameter_per_field_with_the_config_defaults():
    params = inspect.signature(toy_pipeline.pipeline_func).parameters
    assert list(params) == [f"toy_{name}" for name in ToyConfig.model_fields] + ["suffix"]
    defaults = {name: p.default for name, p in params.items() if name != "suffix"}
    assert defaults == {**config_arguments(ToyConfig(), prefix="toy_"), "toy_label": None}


def test_fields_travel_through_a_local_run_with_their_types(tmp_path):
    """The generated source runs in KFP's own executor (kfp.local), as in a pod."""
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    task = toy_pipeline(toy_count=9, toy_nested={"depth": 5}, toy_label="x", toy_factor="3")
    received = json.loads(task.output.removesuffix("!"))
    expected = ToyConfig(count=9, nested=Nested(depth=5), label="x", factor=3).model_dump(
        mode="json"
    )
    assert ToyConfig.model_validate(received).model_dump(mode="json") == expected
    assert received["count"] == 9 and received["label"] == "x"
    assert json.loads(echo_config(**config_arguments(ToyConfig())).output)["label"] is None


@pytest.fixture
def data_prep_with_a_new_field(monkeypatch):
    """``DataPrepConfig`` with one more field, ``shuffle_buffer``, as if added to the class;
    the component and pipeline modules are re-imported against it (and back afterwards).
    The instances the component builds are recorded."""
    built: list[DataPrepConfig] = []

    class WithShuffleBuffer(DataPrepConfig):
        shuffle_buffer: int = Field(7, ge=1)

        def model_post_init(self, context) -> None:
            built.append(self)

    monkeypatch.setattr(data_prep.config, "DataPrepConfig", WithShuffleBuffer)
    component = importlib.reload(importlib.import_module("components.data_prep"))
    pipeline = importlib.reload(importlib.import_module("pipelines.pipeline"))
    try:
        yield component, pipeline, built
    finally:
        monkeypatch.undo()
        importlib.reload(component)
        importlib.reload(pipeline)


def test_a_field_added_to_data_prep_config_reaches_the_pipeline_and_the_component(
    data_prep_with_a_new_field, tmp_path
):
    component, pipeline, built = data_prep_with_a_new_field
    path = tmp_path / "p.yaml"
    compiler.Compiler().compile(pipeline.build_pipeline(), str(path))
    spec = next(yaml.safe_load_all(path.read_text()))
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["data_shuffle_buffer"]["defaultValue"] == 7
    assert root["data_shuffle_buffer"]["parameterType"] == "NUMBER_INTEGER"
    inputs = spec["components"]["comp-data-prep"]["inputDefinitions"]["parameters"]
    assert inputs["shuffle_buffer"]["parameterType"] == "NUMBER_INTEGER"
    task = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["data-prep"]
    argument = task["inputs"]["parameters"]["shuffle_buffer"]
    assert argument == {"componentInputParameter": "pipelinechannel--data_shuffle_buffer"}

    # the component's function (what KFP's executor calls in the pod) gets it as well
    from kfp.dsl import Dataset, Markdown, Metrics

    def outputs(directory: str) -> dict:
        kinds = {"train_data": Dataset, "eval_data": Dataset, "quarantine": Dataset}
        kinds |= {"metrics": Metrics, "card": Markdown}
        return {
            n: k(name=n, uri=str(tmp_path / directory / n), metadata={}) for n, k in kinds.items()
        }

    fields = config_arguments(DataPrepConfig())
    component.data_prep.python_func(**fields, shuffle_buffer=3, **outputs("run"))
    assert built[-1].shuffle_buffer == 3
    assert (tmp_path / "run" / "train_data").stat().st_size > 0
    with pytest.raises(ValueError, match="shuffle_buffer"):  # validated by the class
        component.data_prep.python_func(**fields, shuffle_buffer=0, **outputs("bad"))
