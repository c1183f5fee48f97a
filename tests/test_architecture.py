"""docs/architecture.md is what tools/architecture.py reads from the code today."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "architecture", ROOT / "tools" / "architecture.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_picture_matches_the_code():
    tool = _tool()
    assert (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8") == tool.render(), (
        "docs/architecture.md is stale: run python tools/architecture.py"
    )


def test_every_package_of_the_import_rules_is_drawn():
    from test_import_direction import PACKAGES

    assert set(_tool().PACKAGES) == set(PACKAGES)
