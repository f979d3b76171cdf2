"""The converted-copy cache of small GGUF files (engine/model/gguf_cache.py) steps aside, with a warning that says why,
where it cannot convert: no room on the cache's disk, or a file transformers cannot read."""

import logging
from collections import namedtuple

import pytest

from specserve.engine.model import gguf_cache

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def small_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"not a gguf file" * 64)
    return path


def test_no_room_for_the_fp32_copy_reads_the_file_and_says_so(small_file, monkeypatch, caplog):
    need = gguf_cache.room_needed(small_file)
    assert need == small_file.stat().st_size * gguf_cache.ROOM_PER_FILE_BYTE
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda _: Usage(1 << 40, 1 << 40, need - 1))
    with caplog.at_level(logging.WARNING, "specserve.engine"):
        assert gguf_cache.converted(small_file) is None
    assert "MB free" in caplog.text and "reads the file itself" in caplog.text
    assert not gguf_cache.entry(small_file).exists()


def test_an_unreadable_file_is_not_converted_and_the_warning_names_why(small_file, caplog):
    with caplog.at_level(logging.WARNING, "specserve.engine"):
        assert gguf_cache.converted(small_file) is None
    assert "not a readable GGUF file" in caplog.text
    assert not gguf_cache.entry(small_file).exists()
    assert not [p for p in gguf_cache.cache_root().iterdir() if p.name.startswith(".")]  # no partial copy left
