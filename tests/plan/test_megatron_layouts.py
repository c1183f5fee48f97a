"""The named Megatron layouts below the trainer (``plan.megatron_layouts``): the sizes the plan
reads from a layout are the ones the trainer's layout model gives, for every way a layout is
named."""

import pytest

from cluster.hardware import Hardware
from cluster.nodes import NODE_TYPES
from plan import (
    MEGATRON_LAYOUT_PRESETS,
    MEGATRON_MACHINE_FIELDS,
    ParallelSizes,
    UnknownMegatronLayoutError,
    megatron_sizes,
)
from trainer.megatron.layout import LayoutError, resolve_megatron_layout

LAYOUTS = [
    *MEGATRON_LAYOUT_PRESETS,
    *({"preset": name} for name in MEGATRON_LAYOUT_PRESETS),
    {"preset": "verl-gpt-oss-8x8-h100", "pp": 2, "nodes": 2},
    {"preset": "tiny-cpu", "tp": 2, "dp": 3},
    {"tp": 4, "ep": 2, "cp": 2},
    {},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_the_plan_reads_the_sizes_the_trainer_builds(layout):
    assert megatron_sizes(layout) == resolve_megatron_layout(layout).parallel_sizes


def test_a_layout_that_names_no_size_is_one_process_of_everything():
    assert megatron_sizes("tiny-cpu") == ParallelSizes()


def test_an_unknown_preset_is_named_with_the_presets_by_both():
    with pytest.raises(UnknownMegatronLayoutError, match="unknown Megatron layout 'nope'; "):
        megatron_sizes({"preset": "nope"})
    with pytest.raises(LayoutError, match="preset: unknown Megatron layout 'nope'; presets: "):
        resolve_megatron_layout("nope")


@pytest.mark.parametrize("node_type", sorted(NODE_TYPES))
def test_the_machine_fields_are_the_ones_the_machines_give(node_type):
    """What a preset's layout may not state is what ``Hardware.megatron_fields`` sets."""
    fields = Hardware(node_type=node_type).megatron_fields(1)
    assert set(fields) <= set(MEGATRON_MACHINE_FIELDS)
    assert {"nodes", "gpus_per_node"} <= set(fields)
