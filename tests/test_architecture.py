"""docs/architecture.md is what tools/architecture.py reads from the code today."""

from pathlib import Path

from test_import_direction import PACKAGES, architecture_tool

ROOT = Path(__file__).resolve().parents[1]


def test_the_architecture_picture_matches_the_code():
    assert (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8") == (
        architecture_tool().render()
    ), "docs/architecture.md is stale: run python tools/architecture.py"


def test_every_package_of_the_import_rules_is_drawn():
    assert set(architecture_tool().PACKAGES) == set(PACKAGES)
