"""The tiny model files the engine tests and the dev stack run on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from devstack.gguf_tiny import write_tiny_gguf
from tests.fixtures.engines import MakeGguf


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.fields.get(key)
    assert field is not None, f"{key} missing from the GGUF"
    return field.contents()


def test_tiny_llama_gguf_is_under_one_megabyte_and_reads_back_as_llama(make_gguf: MakeGguf) -> None:
    path = make_gguf()
    assert path.stat().st_size < 1_000_000
    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.context_length") == 256
    assert _field(reader, "tokenizer.ggml.model") == "llama"
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 2
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == 260
    assert tokens[:3] == ["<unk>", "<s>", "</s>"] and tokens[3 + 0x41] == "<0x41>"
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.ffn_down.weight"} <= names


def test_other_architecture_carries_its_own_name_on_every_model_key(make_gguf: MakeGguf) -> None:
    reader = gguf.GGUFReader(make_gguf("kev"))
    assert _field(reader, "general.architecture") == "kev"
    assert _field(reader, "kev.context_length") == 256
    assert not [k for k in reader.fields if k.startswith("llama.")]


def test_same_seed_writes_the_same_file_and_another_seed_does_not(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=1).read_bytes()
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=1).read_bytes()
    c = write_tiny_gguf(tmp_path / "c.gguf", seed=2).read_bytes()
    assert a == b
    assert a != c


def test_command_line_writes_the_architecture_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "kev.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "devstack.gguf_tiny", str(out), "--arch", "kev"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 0, proc.stderr
    assert "architecture kev" in proc.stdout
    assert _field(gguf.GGUFReader(out), "general.architecture") == "kev"


def test_architecture_that_is_not_a_plain_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="architecture"):
        write_tiny_gguf(tmp_path / "x.gguf", architecture="../etc")
