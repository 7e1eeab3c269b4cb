"""A worker rank's publisher (:mod:`s3kv.tiering.worker.publisher`): none
without S3; with it, the journal of the rank's stores where the front end
asked for one (S3KV_JOURNAL_DIR), and a warning, not a failure, where that
journal cannot be written. Against the in-memory store."""

import json
import logging

from s3kv.config import parse_config
from s3kv.manifest.journal import ENV_VAR as JOURNAL_ENV
from s3kv.manifest.protocol import manifest_prefix
from s3kv.stats import Counters
from s3kv.stores.memory import MemoryStore
from s3kv.tiering.worker.publisher import start_publisher
from s3kv.tiering.worker.transfer import EngineSettings, TransferEngine

NS = "n" * 32
CONFIG = parse_config({"bucket": "test-bucket", "prefix": "p"})


def engine(store):
    return TransferEngine(store, EngineSettings(namespace=None, prefix="p", rank=1, num_layers=2))


def publisher(e):
    return start_publisher(e, CONFIG, NS, "writer", rank=1, ranks=2, counters=Counters())


def test_a_rank_without_s3_publishes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    e = engine(None)
    assert publisher(e) is None
    assert list(tmp_path.iterdir()) == []  # and journals nothing
    e.close()


def test_a_rank_journals_its_stores_where_the_front_end_asked(tmp_path, monkeypatch):
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    e = engine(MemoryStore())
    p = publisher(e)
    assert p is not None and p.journal is not None and (p.rank, p.ranks) == (1, 2)
    info = json.loads((tmp_path / "writerr1.json").read_text())
    assert (info["writer"], info["namespace"], info["rank"], info["ranks"]) == ("writerr1", NS, 1, 2)
    assert info["base"] == manifest_prefix("p", NS) and info["config"]["prefix"] == "p"
    e.close()
    assert p.close() == 0


def test_a_journal_that_cannot_be_written_is_warned_of_and_the_rank_still_publishes(
    tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="s3kv")
    monkeypatch.setenv(JOURNAL_ENV, str(tmp_path))
    (tmp_path / "writerr1.json").mkdir()  # in the way of the journal's first file
    e = engine(MemoryStore())
    p = publisher(e)
    assert p is not None and p.journal is None
    assert "no journal of this rank's stores" in caplog.text
    e.close()
    p.close()


def test_without_a_journal_directory_a_rank_publishes_unjournaled(monkeypatch):
    monkeypatch.delenv(JOURNAL_ENV, raising=False)
    e = engine(MemoryStore())
    p = publisher(e)
    assert p is not None and p.journal is None
    e.close()
    p.close()
