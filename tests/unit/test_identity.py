import json
import os
import shutil
import time

import pytest

from s3kv import identity
from s3kv.errors import IdentityError
from s3kv.identity import DigestCache, ModelSource, resolve_identity

MIB = 1 << 20


def _model(d, weights: bytes):
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def _ident(path, cache=None):
    return resolve_identity(ModelSource(str(path)), cache)


@pytest.fixture
def hashed(monkeypatch):
    """Counts the files read whole by the identity code."""
    calls = []
    real = identity.hash_file

    def counting(path, buffer=None):
        calls.append(path.name)
        return real(path, buffer)

    monkeypatch.setattr(identity, "hash_file", counting)
    return calls


def test_content_not_path_decides(tmp_path):
    weights = bytes(range(256)) * 8192
    a = _model(tmp_path / "a", weights)
    b = tmp_path / "elsewhere"
    shutil.copytree(a, b)
    assert _ident(a) == _ident(b)
    other = bytearray(weights)
    other[0] ^= 1  # same size, same config, other weights
    c = _model(tmp_path / "c", bytes(other))
    assert _ident(c) != _ident(a)


def test_every_byte_counts(tmp_path):
    # Two fine-tunes alike but for a few bytes between where the old sampled
    # fingerprint looked (8 windows of 64 KiB): they must not share a namespace.
    weights = os.urandom(9 * MIB)
    a = _model(tmp_path / "a", weights)
    for offset in (MIB + 7, 4 * MIB + 123, 9 * MIB - (64 << 10) - 1):
        other = bytearray(weights)
        other[offset] ^= 0x40
        d = tmp_path / f"m{offset}"
        _model(d, bytes(other))
        assert _ident(d) != _ident(a), offset


def test_config_files_count_and_other_files_do_not(tmp_path):
    a = _model(tmp_path / "a", b"w" * 1000)
    before = _ident(a)
    (a / "README.md").write_text("docs")
    assert _ident(a) == before
    (a / "hf_quant_config.json").write_text('{"quant_algo": "FP8"}')
    assert _ident(a) != before


def test_a_single_weights_file_is_a_model(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"g" * 5000)
    first = _ident(f)
    f.write_bytes(b"h" * 5000)
    assert _ident(f) != first


def test_digests_are_cached_by_file_version(tmp_path, hashed):
    cache_path = tmp_path / "cache" / "digests.json"
    a = _model(tmp_path / "a", os.urandom(3 * MIB))
    first = _ident(a, DigestCache(cache_path))
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    # A restart (a new cache object, from the file) reads nothing again.
    assert _ident(a, DigestCache(cache_path)) == first
    assert hashed == []
    # A changed file (new mtime) is hashed again, and only it.
    weights = a / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[MIB] ^= 1
    weights.write_bytes(bytes(data))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = _ident(a, DigestCache(cache_path))
    assert hashed == ["model.safetensors"] and second != first


def test_a_broken_cache_file_only_costs_a_rehash(tmp_path, hashed):
    cache_path = tmp_path / "digests.json"
    cache_path.write_text("{not json")
    a = _model(tmp_path / "a", b"w" * 4096)
    first = _ident(a, DigestCache(cache_path))
    assert "model.safetensors" in hashed
    assert json.loads(cache_path.read_text())["xxh3_128"]  # rewritten whole
    cache_path.write_text(json.dumps({"xxh3_128": {"bogus": 1}}))
    assert _ident(a, DigestCache(cache_path)) == first


def test_model_digest_skips_hashing(tmp_path, hashed):
    a = _model(tmp_path / "a", b"w" * 4096)
    one = resolve_identity(ModelSource(str(a), digest="sha256:" + "ab" * 32))
    assert hashed == []
    assert one["model_digest"] == "sha256:" + "ab" * 32
    assert one != resolve_identity(ModelSource(str(a), digest="sha256:" + "cd" * 32))
    # Without a local copy (weights streamed from elsewhere) the digest alone names them.
    assert resolve_identity(ModelSource("s3://models/llama", digest="registry:v7")) == {
        "model_digest": "registry:v7"
    }


def test_no_weights_or_unreadable_weights_fail(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(IdentityError, match="holds no weight files"):
        _ident(d)
    with pytest.raises(IdentityError, match="neither a local path nor a hub id"):
        _ident("s3://bucket/model")


def _hub_cache(base, repo, refs):
    folder = base / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    for name, sha in refs.items():
        (folder / "refs" / name).write_text(sha)
        (folder / "snapshots" / sha).mkdir(parents=True)
    return folder


def test_hub_models_use_the_resolved_snapshot_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(identity, "hub_cache_dirs", lambda download_dir=None: [tmp_path / "hub"])
    main_sha, old_sha = "a" * 40, "b" * 40
    _hub_cache(tmp_path / "hub", "org/model", {"main": main_sha, "v1": old_sha})
    got = resolve_identity(ModelSource("org/model"))
    assert got == {"hub_model": "org/model", "commit": main_sha}  # not the name "main"
    assert resolve_identity(ModelSource("org/model", revision="v1"))["commit"] == old_sha
    assert resolve_identity(ModelSource("org/model", revision=old_sha))["commit"] == old_sha
    # "main" moved on: another namespace.
    (tmp_path / "hub" / "models--org--model" / "refs" / "main").write_text("c" * 40)
    assert resolve_identity(ModelSource("org/model"))["commit"] == "c" * 40
    with pytest.raises(IdentityError, match="not in the local hub cache"):
        resolve_identity(ModelSource("org/other"))
    with pytest.raises(IdentityError, match="not in the local hub cache"):
        resolve_identity(ModelSource("org/model", revision="no-such-branch"))


def test_download_dir_is_searched_first(tmp_path):
    _hub_cache(tmp_path / "dl", "org/model", {"main": "d" * 40})
    assert identity.hub_commit("org/model", None, identity.hub_cache_dirs(str(tmp_path / "dl"))) == "d" * 40


def test_a_file_rewritten_with_its_mtime_set_back_is_hashed_again(tmp_path, hashed):
    """mtime can be set back (``touch -d``, ``cp -p``, ``rsync -t``); ctime cannot."""
    cache_path = tmp_path / "digests.json"
    a = _model(tmp_path / "a", b"w" * 4096)
    first = _ident(a, DigestCache(cache_path))
    weights = a / "model.safetensors"
    before = weights.stat()
    # The rewrite must get a later ctime: on a coarse clock, rewrite until it
    # does (the clock moving is what the test needs, so it waits for that).
    deadline = time.monotonic() + 60
    while True:
        weights.write_bytes(b"W" * 4096)  # same size, other weights
        os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = weights.stat()
        if after.st_ctime_ns != before.st_ctime_ns:
            break
        assert time.monotonic() < deadline, "the file's ctime did not move"
        time.sleep(0.001)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )
    hashed.clear()
    assert _ident(a, DigestCache(cache_path)) != first and hashed == ["model.safetensors"]


def test_a_cache_file_without_ctimes_still_loads(tmp_path, hashed):
    """Entries an older s3kv wrote (device:inode:size:mtime) are simply missed."""
    cache_path = tmp_path / "digests.json"
    a = _model(tmp_path / "a", b"w" * 4096)
    st = (a / "model.safetensors").stat()
    old_key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
    cache_path.write_text(json.dumps({"xxh3_128": {old_key: "0" * 32}}))
    cache = DigestCache(cache_path)
    assert cache.get(st) is None
    first = _ident(a, cache)
    assert "model.safetensors" in hashed
    hashed.clear()
    assert _ident(a, DigestCache(cache_path)) == first and hashed == []  # cached anew, with its ctime
