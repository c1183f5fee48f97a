"""The packages import one way (docs/layout.md): pipelines → components → the steps
(data_prep, trainer, eval, capacity, cluster); eval and trainer → (reward, generation);
trainer → (capacity, plan, cluster); capacity → (plan, cluster); plan (the run's shape) →
cluster (the machine facts) and core; all of them → core,
which imports none of the project's packages. Every package of the repository is checked. And no two
modules import each other. Read from the source with ``ast``, lazy (function-level) imports
included."""

import ast
import functools
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "core",
    "reward",
    "generation",
    "data_prep",
    "trainer",
    "eval",
    "capacity",
    "plan",
    "cluster",
    "components",
    "pipelines",
)
STEPS = {"data_prep", "trainer", "eval", "capacity", "cluster"}
ALLOWED = {
    "core": set(),
    "reward": {"core"},
    "generation": {"core"},
    "eval": {"core", "reward", "generation"},
    "data_prep": {"core"},
    "cluster": {"core"},
    "plan": {"core", "cluster"},
    "capacity": {"core", "plan", "cluster"},
    "trainer": {"core", "reward", "generation", "capacity", "plan", "cluster"},
    "components": {"core", "reward", "generation", "plan"} | STEPS,
    "pipelines": {"core", "reward", "generation", "plan", "components"} | STEPS,
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


# Two-file import circles (a imports b, b imports a), lazy and TYPE_CHECKING imports included:
# each is two modules that cannot be read, tested or moved apart. The bench scripts import one
# another by their file names (``bench/`` is on their path), so they are read as modules too.
def module_files() -> dict[str, Path]:
    """Every product module (the packages, and bench's scripts), by its import name."""
    files = {}
    for path in [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in (ROOT / "bench").glob("*.py"):
        files[path.stem] = path
    return files


def imported_modules(path: Path, modules) -> set[str]:
    """The modules among ``modules`` that the module at ``path`` imports (``from a.b import c``
    is ``a.b.c`` when that is a module, else ``a.b``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def two_file_circles(files: dict[str, Path]) -> set[tuple[str, str]]:
    graph = {module: imported_modules(path, files) - {module} for module, path in files.items()}
    return {(a, b) for a in graph for b in graph[a] if a < b and a in graph[b]}


def test_no_two_modules_import_each_other():
    circles = two_file_circles(module_files())
    assert not circles, "import circles: " + ", ".join(f"{a} <-> {b}" for a, b in sorted(circles))


def test_the_circle_check_sees_lazy_and_type_checking_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("from pkg.a import x\n")
    files = {f"pkg.{name}": tmp_path / "pkg" / f"{name}.py" for name in "abc"}
    assert two_file_circles(files) == {("pkg.a", "pkg.b")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _product(module: str) -> bool:
    return module.split(".")[0] in (*PACKAGES, "bench")


def private_names_in_bench(paths=None) -> set[tuple[str, str]]:
    """``(bench file, module.name)`` of every private name a bench script takes from the
    product or from another bench script: imported (``from m import _x``) or reached through
    an imported name (``from trainer.grpo import recipe`` then ``recipe._x``)."""
    found = set()
    for path in paths or sorted((ROOT / "bench").glob("*.py")):
        where = path.relative_to(path.parents[1]).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound: dict[str, str] = {}  # a name the script binds -> what it is in the product
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if not _product(node.module):
                    continue
                for alias in node.names:
                    if _private(alias.name):
                        found.add((where, f"{node.module}.{alias.name}"))
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _product(alias.name) and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _private(node.attr)
            ):
                found.add((where, f"{bound[node.value.id]}.{node.attr}"))
    return found


def test_the_private_name_check_sees_imports_and_attributes(tmp_path):
    (tmp_path / "bench").mkdir()
    script = tmp_path / "bench" / "probe.py"
    script.write_text(
        "import json\n"
        "import trainer.grpo.update as upd\n"
        "from trainer.grpo import recipe\n"
        "from trainer.grpo.update import _right_aligned, Batch\n"
        "recipe._sync(); upd._loss_fn(); Batch.__name__; json._default_encoder\n"
    )
    assert private_names_in_bench([script]) == {
        ("bench/probe.py", "trainer.grpo.recipe._sync"),
        ("bench/probe.py", "trainer.grpo.update._loss_fn"),
        ("bench/probe.py", "trainer.grpo.update._right_aligned"),
    }


def test_bench_imports_only_public_names():
    private = private_names_in_bench()
    assert not private, "private names used by bench/: " + ", ".join(sorted(map(str, private)))
