"""The GRPO recipe wires builders together and picks none of them by name: the engines,
backends and policy losses come from registries keyed by the config's names
(``trainer.grpo.engines.ENGINES``, ``trainer.backends.BACKENDS``,
``trainer.grpo.algorithm.POLICY_LOSSES``), and what an engine or backend may or may not do is
in its protocol, so no ``hasattr`` either. Read from the source with ``ast``."""

import ast
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "trainer" / "grpo" / "recipe.py"


def name_dispatch(source: str) -> list[str]:
    """Each equality test with a string literal (``==``, ``!=``) and each
    ``hasattr``/``getattr`` call, as ``line: code``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        compared = (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
            and any(
                isinstance(side, ast.Constant) and isinstance(side.value, str)
                for side in (node.left, *node.comparators)
            )
        )
        probed = (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
        )
        if compared or probed:
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_the_check_sees_string_comparisons_and_attribute_probes():
    source = (
        'if cfg.optim.backend == "deepspeed":\n    pass\n'
        'x = "vllm" != engine or hasattr(engine, "sleep")\n'
        'ok = cfg.engine is None and step == 3 and "loss" in stats\n'
    )
    assert name_dispatch(source) == [
        '1: cfg.optim.backend == "deepspeed"',
        '3: "vllm" != engine',
        '3: hasattr(engine, "sleep")',
    ]


def test_the_grpo_recipe_picks_nothing_by_name():
    found = name_dispatch(RECIPE.read_text(encoding="utf-8"))
    assert not found, "the recipe dispatches on names: " + "; ".join(found)
