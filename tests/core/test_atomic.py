"""core/atomic.py's output folders (issue #32 item 1): a folder is replaced only when its record
lists everything in it; a refusal removes nothing. The writers: tests/test_output_folders.py."""

from __future__ import annotations

import json

import pytest

from core.atomic import (
    OUTPUT_RECORD,
    OutputNotOursError,
    check_output_dir,
    publish_dir,
    staging_dir,
)


def test_publish_dir_replaces_our_folder_and_refuses_one_that_is_not(tmp_path):
    target = tmp_path / "model"
    first = staging_dir(target)
    (first / "weights").write_text("1")
    publish_dir(first, target)
    assert json.loads((target / OUTPUT_RECORD).read_text())["entries"] == ["weights"]
    second = staging_dir(target)
    (second / "weights").write_text("2")
    (second / "config").write_text("c")
    publish_dir(second, target)  # ours: swapped in, the old one removed
    assert (target / "weights").read_text() == "2" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    (target / "notes.txt").write_text("the user's")  # now the folder holds a file not ours
    third = staging_dir(target)
    (third / "weights").write_text("3")
    refused = r"did not write \(notes.txt\); nothing was removed.*kept in .*\.model\.partial"
    with pytest.raises(OutputNotOursError, match=refused):
        publish_dir(third, target)
    assert (target / "notes.txt").exists() and (target / "weights").read_text() == "2"
    assert (third / "weights").read_text() == "3"  # what the run wrote is kept


def test_check_output_dir_refuses_files_links_and_a_work_dir_inside(tmp_path):
    check_output_dir(tmp_path / "new")  # missing: fine
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty")  # empty: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputNotOursError, match="is a file"):
        check_output_dir(tmp_path / "file")
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    with pytest.raises(OutputNotOursError, match="symbolic link"):
        check_output_dir(tmp_path / "link")
    with pytest.raises(OutputNotOursError, match="work folder .* lies inside"):
        check_output_dir(tmp_path / "out", "--model-output", work_dir=tmp_path / "out" / "w")
    with pytest.raises(OutputNotOursError, match="work folder .* lies inside"):
        check_output_dir(tmp_path / "out", "--model-output", work_dir=tmp_path / "out")


def test_a_staging_folder_we_did_not_make_is_not_removed(tmp_path):
    stale = staging_dir(tmp_path / "model")  # a killed run's: ours, removed by the next one
    (stale / "half.bin").write_text("x")
    assert list(staging_dir(tmp_path / "model").iterdir()) == [stale / OUTPUT_RECORD]
    foreign = tmp_path / ".data.partial"
    foreign.mkdir()
    (foreign / "keep").write_text("x")
    with pytest.raises(OutputNotOursError, match="did not make it"):
        staging_dir(tmp_path / "data")
    assert (foreign / "keep").exists()
