"""Hugging Face checkpoints (issue 47): ``save_hf`` / ``async-ckpt export --format hf`` write
sharded safetensors and ``model.safetensors.index.json`` as ``save_pretrained`` does, read back
bitwise by ``safetensors``, ``load_hf`` and ``transformers.from_pretrained``; a dtype on export
and a cast on load; nothing else in the directory is touched."""

from __future__ import annotations

import json
import os

import pytest
import torch

from async_ckpt import CheckpointManager, InvalidStateDictError, StateDictMismatchError
from async_ckpt.cli import main
from async_ckpt.io.hf import INDEX_NAME, load_hf, save_hf, shard_files

from ..conftest import assert_bitwise_equal


def _tensors():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(64, 32, generator=g)
    return {
        "embed.weight": torch.randn(100, 16, generator=g),
        "layers.0.w": base,
        "layers.0.view": base[:, :8],  # a view of another tensor's storage (not contiguous)
        "layers.0.b16": torch.randn(40, generator=g).to(torch.bfloat16),
        "layers.0.count": torch.arange(7, dtype=torch.int64),
        "layers.1.scalar": torch.tensor(2.5),
        "layers.1.empty": torch.empty(0, 3),
    }


def test_shards_and_index_as_save_pretrained_writes_them_read_back_bitwise(tmp_path):
    t = _tensors()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the user's file beside ours
    files = save_hf(t, str(out), max_shard_bytes=8 * 1024)
    assert files[-1] == INDEX_NAME and len(files) >= 3
    shards = files[:-1]
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(t) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values())
    from safetensors.torch import load_file

    read = {}
    for s in shards:
        read.update(load_file(str(out / s)))
    assert_bitwise_equal(read, t)
    assert (out / "config.json").read_text() == "{}"
    assert sorted(os.listdir(out)) == sorted([*files, "config.json"])  # nothing else: no temp files
    targets = {k: torch.zeros_like(v) for k, v in t.items()}
    assert load_hf(str(out), targets) is targets
    assert_bitwise_equal(targets, t)
    assert_bitwise_equal(load_hf(str(out)), t)
    assert shard_files(str(out)) == index["weight_map"]


def test_a_dtype_on_export_and_a_cast_on_load(tmp_path):
    t = {"w": torch.randn(10, 10), "i": torch.arange(4)}
    save_hf(t, str(tmp_path), dtype=torch.bfloat16)
    stored = load_hf(str(tmp_path))
    assert stored["w"].dtype == torch.bfloat16 and stored["i"].dtype == torch.int64  # integers keep theirs
    target = {"w": torch.zeros(10, 10), "i": torch.zeros(4, dtype=torch.int64)}
    load_hf(str(tmp_path), target)
    assert_bitwise_equal(target["w"], t["w"].to(torch.bfloat16).to(torch.float32))
    with pytest.raises(StateDictMismatchError, match="stored as torch.bfloat16.*cast=True"):
        load_hf(str(tmp_path), {"w": torch.zeros(10, 10)}, cast=False)


def test_bad_input_and_mismatches_are_named(tmp_path):
    with pytest.raises(InvalidStateDictError, match="'n' is a int"):
        save_hf({"n": 3}, str(tmp_path / "x"))
    save_hf({"w": torch.ones(2, 2)}, str(tmp_path))
    with pytest.raises(StateDictMismatchError, match="no tensor named extra.*strict=False"):
        load_hf(str(tmp_path), {"w": torch.zeros(2, 2), "extra": torch.zeros(1)})
    target = {"w": torch.zeros(2, 2), "extra": torch.zeros(1)}
    load_hf(str(tmp_path), target, strict=False)
    assert target["w"].eq(1).all() and target["extra"].eq(0).all()
    with pytest.raises(StateDictMismatchError, match=r"shape is \(2, 2\), the target's \(4,\)"):
        load_hf(str(tmp_path), {"w": torch.zeros(4)})
    with pytest.raises(FileNotFoundError, match="holds no Hugging Face checkpoint"):
        load_hf(str(tmp_path / "nowhere"))


def test_cli_export_format_hf_is_read_by_transformers_from_pretrained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(str(root))
    mgr.save(3, {"model": model.state_dict(), "step": 3})
    mgr.close()
    out = tmp_path / "hf"
    assert main(["export", str(root), "latest", str(out), "--format", "hf", "--key", "model",
                 "--max-shard-size", "20KB", "--dtype", "bfloat16"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("exported step 3 (") and "shards and model.safetensors.index.json" in said
    config.save_pretrained(str(out))  # the user adds the config, as save_pretrained would have
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.bfloat16)
    want = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert_bitwise_equal(loaded.state_dict(), want)
    # OUT not empty: refused without --force; with it only our files are replaced
    assert main(["export", str(root), "3", str(out), "--format", "hf", "--key", "model"]) != 0
    assert "exists and is not empty: pass --force" in capsys.readouterr().err
    assert main(["export", str(root), "3", str(out), "--format", "hf", "--key", "model", "--force"]) == 0
    assert (out / "config.json").exists()
    fp32 = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_hf(str(out), fp32)
    assert_bitwise_equal(fp32, model.state_dict())
