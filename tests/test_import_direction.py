"""The packages import one way (README "Layout"): pipelines → components → the steps
(data_prep, trainer, eval, capacity, cluster); eval and trainer → reward; trainer →
(capacity, cluster); capacity → cluster (the node types); all of them → core, which imports
none of the project's packages. Every package of the repository is checked. Read from the
source with ``ast``, lazy (function-level) imports included."""

import functools
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "core",
    "reward",
    "data_prep",
    "trainer",
    "eval",
    "capacity",
    "cluster",
    "components",
    "pipelines",
)
STEPS = {"data_prep", "trainer", "eval", "capacity", "cluster"}
ALLOWED = {
    "core": set(),
    "reward": {"core"},
    "eval": {"core", "reward"},
    "data_prep": {"core"},
    "cluster": {"core"},
    "capacity": {"core", "cluster"},
    "trainer": {"core", "reward", "capacity", "cluster"},
    "components": {"core", "reward"} | STEPS,
    "pipelines": {"core", "reward", "components"} | STEPS,
}
# The one exception: the tiny model's tokenizer is trained on the bundled sample as data
# prep renders it and on the eval set's questions, so its corpus comes from data_prep and
# eval (lazy imports in one function, trainer.tiny_model.bundled_corpus).
EXCEPTIONS = {("trainer/tiny_model.py", "data_prep"), ("trainer/tiny_model.py", "eval")}


@functools.cache
def architecture_tool():
    """tools/architecture.py, which reads the imports for the picture as well (loaded once)."""
    spec = importlib.util.spec_from_file_location(
        "architecture", ROOT / "tools" / "architecture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imported_packages(path: Path) -> set[str]:
    return architecture_tool().imported_packages(path, PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_one_way(package):
    wrong = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for other in imported_packages(path) - {package} - ALLOWED[package]:
            if (rel, other) not in EXCEPTIONS:
                wrong.append(f"{rel} imports {other}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from trainer.x import y\n    import components.z\n")
    assert imported_packages(module) == {"trainer", "components"}


def test_every_package_of_the_repository_is_checked():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages == set(PACKAGES) == set(ALLOWED)


@pytest.mark.parametrize(("rel", "other"), sorted(EXCEPTIONS))
def test_each_exception_is_still_needed(rel, other):
    assert other in imported_packages(ROOT / rel), f"{rel} no longer imports {other}: drop it"
