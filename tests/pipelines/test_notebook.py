"""The RHOAI notebook is a valid notebook whose code uses the project's real API."""

import ast
import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "rhoai_lingo_rl.ipynb"


def _code_cells():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def test_code_cells_parse_and_import_what_exists():
    import importlib

    for source in _code_cells():
        python = "\n".join(line for line in source.splitlines() if not line.startswith("%"))
        tree = ast.parse(python)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in (
                "pipelines",
                "trainer",
                "eval",
                "data_prep",
                "core",
                "reward",
            ):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"


def test_the_configure_cell_builds_a_valid_preset():
    namespace: dict = {}
    exec(_code_cells()[1], namespace)  # the "Configure" cell
    assert namespace["preset"].grpo.max_steps == 100
