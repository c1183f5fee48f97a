"""The manifest next to a converted Megatron checkpoint: hash, atomic write, checks."""

import hashlib
import json
import os
from importlib.metadata import version

import pytest

from trainer.megatron.layout import MEGATRON_LAYOUTS, MegatronLayout
from trainer.megatron.manifest import (
    MANIFEST_FILE,
    ManifestError,
    ManifestMismatch,
    build_manifest,
    check_manifest,
    hash_hf_directory,
    read_manifest,
    write_manifest,
)

TINY = MEGATRON_LAYOUTS["tiny-cpu"]


@pytest.fixture
def hf_dir(tmp_path):
    """A HF-like directory: config, two weight shards, tokenizer files (not hashed)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "gpt_oss"}')
    (d / "model-00001-of-00002.safetensors").write_bytes(b"\x01" * 3000)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\x02" * 5)
    (d / "tokenizer.json").write_text("{}")
    return d


def test_hash_is_sha256_over_name_size_and_bytes_of_config_and_weights(hf_dir):
    digest, files = hash_hf_directory(hf_dir)
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    expected = hashlib.sha256()
    for name in files:
        data = (hf_dir / name).read_bytes()
        expected.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert digest == expected.hexdigest()


def test_hash_changes_with_weights_and_names_but_not_with_tokenizer_files(hf_dir):
    before, _ = hash_hf_directory(hf_dir)
    (hf_dir / "tokenizer.json").write_text('{"changed": true}')
    assert hash_hf_directory(hf_dir)[0] == before
    shard = hf_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(b"\x02" * 4 + b"\x03")
    changed, _ = hash_hf_directory(hf_dir)
    assert changed != before
    shard.write_bytes(b"\x02" * 5)
    assert hash_hf_directory(hf_dir)[0] == before
    shard.rename(hf_dir / "model-renamed.safetensors")
    assert hash_hf_directory(hf_dir)[0] != before


def test_hash_needs_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ManifestError, match="safetensors files: 0"):
        hash_hf_directory(tmp_path)


def test_written_manifest_reads_back_with_layout_dtype_hash_versions_and_time(hf_dir, tmp_path):
    layout = MEGATRON_LAYOUTS["verl-gpt-oss-8x8-h100"]
    manifest = build_manifest(hf_dir, layout, world_size=64)
    megatron_dir = tmp_path / "megatron"
    path = write_manifest(megatron_dir, manifest)
    assert path == megatron_dir / MANIFEST_FILE
    assert sorted(os.listdir(megatron_dir)) == [MANIFEST_FILE]  # no temp file left behind
    raw = json.loads(path.read_text())
    assert raw["layout"]["tp"] == 8 and raw["layout"]["ep"] == 8 and raw["layout"]["pp"] == 8
    assert raw["dtype"] == "bf16" and raw["world_size"] == 64
    assert raw["source_sha256"] == hash_hf_directory(hf_dir)[0]
    assert raw["checkpoint_format"] == "torch_dist"
    assert raw["library_versions"]["torch"] == version("torch")
    assert raw["library_versions"]["transformers"] == version("transformers")
    assert "megatron-core" in raw["library_versions"]
    assert raw["created_at"].endswith("+00:00")
    assert read_manifest(megatron_dir) == manifest


def test_a_failed_write_leaves_neither_manifest_nor_temp_file(hf_dir, tmp_path, monkeypatch):
    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_manifest(tmp_path / "megatron", build_manifest(hf_dir, TINY))
    assert os.listdir(tmp_path / "megatron") == []


def test_check_accepts_the_matching_request(hf_dir, tmp_path):
    write_manifest(tmp_path, build_manifest(hf_dir, TINY))
    manifest = check_manifest(tmp_path, layout=TINY, hf_dir=hf_dir)
    assert manifest.layout == TINY
    # data parallelism and placement do not change what the checkpoint holds
    assert check_manifest(tmp_path, layout=TINY.model_copy(update={"dp": 4, "nodes": 2}))


def test_check_names_every_difference(hf_dir, tmp_path):
    write_manifest(tmp_path, build_manifest(hf_dir, TINY))
    (hf_dir / "model-00002-of-00002.safetensors").write_bytes(b"other weights")
    wanted = MegatronLayout(tp=2, params_dtype="bf16", sequence_parallel=True)
    with pytest.raises(ManifestMismatch) as caught:
        check_manifest(tmp_path, layout=wanted, hf_dir=hf_dir)
    message = str(caught.value)
    assert "layout.tp: checkpoint has 1, requested 2" in message
    assert "layout.params_dtype: checkpoint has 'fp32', requested 'bf16'" in message
    assert f"converted from {hf_dir}" in message
    with pytest.raises(ManifestMismatch, match="requested source_sha256 0000"):
        check_manifest(tmp_path, source_sha256="0" * 64)


def test_missing_corrupt_or_inconsistent_manifest_is_an_error(hf_dir, tmp_path):
    with pytest.raises(ManifestError, match="no lingo_manifest.json"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)
    raw = json.loads(build_manifest(hf_dir, TINY).model_dump_json())
    raw["dtype"] = "bf16"  # the layout says fp32
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(raw))
    with pytest.raises(ManifestError, match="differs from layout.params_dtype"):
        read_manifest(tmp_path)


def test_build_refuses_a_source_that_changed_since_it_was_hashed(hf_dir):
    digest, _ = hash_hf_directory(hf_dir)
    assert build_manifest(hf_dir, TINY, source_sha256=digest).source_sha256 == digest
    (hf_dir / "config.json").write_text('{"model_type": "gpt_oss", "x": 1}')
    with pytest.raises(ManifestError, match="source changed"):
        build_manifest(hf_dir, TINY, source_sha256=digest)
