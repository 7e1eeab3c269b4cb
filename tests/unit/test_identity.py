import shutil

from s3kv.identity import model_identity


def _model(d, weights: bytes):
    d.mkdir()
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(weights)
    return d


def test_content_not_path_decides(tmp_path):
    weights = bytes(range(256)) * 8192  # 2 MiB: sampled, not read whole
    a = _model(tmp_path / "a", weights)
    b = tmp_path / "elsewhere"
    shutil.copytree(a, b)
    assert model_identity(str(a)) == model_identity(str(b))
    other = bytearray(weights)
    other[0] ^= 1  # same size, same config, other weights
    c = _model(tmp_path / "c", bytes(other))
    assert model_identity(str(c)) != model_identity(str(a))


def test_hub_names_use_name_and_revision():
    assert model_identity("org/model") == {"model": "org/model", "revision": "main"}
    assert model_identity("org/model", "abc") != model_identity("org/model")
