"""The packages import one way (README "Layout"): pipelines → components → (data_prep,
trainer, eval, capacity, cluster) → core; trainer → (capacity, cluster, eval); capacity →
cluster (the node types). ``core`` imports none of the project's packages. Read from the
source with ``ast``, lazy (function-level) imports included."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "core",
    "data_prep",
    "trainer",
    "eval",
    "capacity",
    "cluster",
    "components",
    "pipelines",
)
ALLOWED = {
    "core": set(),
    "eval": {"core"},
    "data_prep": {"core"},
    "cluster": {"core"},
    "capacity": {"core", "cluster"},
    "trainer": {"core", "eval", "capacity", "cluster"},
    "components": {"core", "data_prep", "trainer", "eval", "capacity", "cluster"},
    "pipelines": {"core", "components", "data_prep", "trainer", "eval", "capacity", "cluster"},
}
# The one exception: the tiny model's tokenizer is trained on the bundled sample as data
# prep renders it, so its corpus comes from data_prep (a lazy import in one function).
EXCEPTIONS = {("trainer/tiny_model.py", "data_prep")}


def _architecture_tool():
    """tools/architecture.py, which reads the imports for the picture as well."""
    spec = importlib.util.spec_from_file_location(
        "architecture", ROOT / "tools" / "architecture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def imported_packages(path: Path) -> set[str]:
    return _architecture_tool().imported_packages(path, PACKAGES)


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
