"""Tiny GGUF model files that llama.cpp really loads and runs (random weights, real inference).

The shape is the one verified on these machines: a llama with embedding 64, 2 blocks, 4 heads,
feed-forward 128, f32 weights, and a byte-level tokenizer, so any text tokenizes and the file
stays under 500 KB. Given another architecture name (`kev`), the same tensors are written with
that name on every key, so llama.cpp refuses the file exactly as it refuses a real model from an
architecture it does not know ("unknown model architecture: 'kev'"), not for a missing key.

    python -m devstack.gguf_tiny OUT.gguf [--arch kev] [--seed 0] [--context 256]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

EMBEDDING = 64
BLOCKS = 2
HEADS = 4
FEED_FORWARD = 128
WEIGHT_STD = 0.02
RMS_EPS = 1e-5

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def tiny_vocab() -> tuple[list[str], list[int]]:
    """`<unk>`, `<s>`, `</s>`, the 256 byte tokens and `▁`, with their llama token types."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁"]
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL]
    )
    return tokens, [int(t) for t in types]


def write_tiny_gguf(
    path: str | Path,
    architecture: str = "llama",
    seed: int = 0,
    context: int = 256,
) -> Path:
    """Write a tiny model to `path` (parents created) and return the path."""
    if not architecture or not architecture.replace("-", "").replace("_", "").isalnum():
        raise ValueError(f"write_tiny_gguf: architecture must be a plain name, got {architecture!r}")
    if context <= 0:
        raise ValueError(f"write_tiny_gguf: context must be positive, got {context}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens, token_types = tiny_vocab()
    vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32)

    # numpy shapes are ggml's dimensions reversed: token_embd is ne [embedding, vocab].
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", weights(vocab, EMBEDDING))]
    for b in range(BLOCKS):
        tensors += [
            (f"blk.{b}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32)),
            (f"blk.{b}.attn_q.weight", weights(EMBEDDING, EMBEDDING)),
            (f"blk.{b}.attn_k.weight", weights(EMBEDDING, EMBEDDING)),
            (f"blk.{b}.attn_v.weight", weights(EMBEDDING, EMBEDDING)),
            (f"blk.{b}.attn_output.weight", weights(EMBEDDING, EMBEDDING)),
            (f"blk.{b}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32)),
            (f"blk.{b}.ffn_gate.weight", weights(FEED_FORWARD, EMBEDDING)),
            (f"blk.{b}.ffn_up.weight", weights(FEED_FORWARD, EMBEDDING)),
            (f"blk.{b}.ffn_down.weight", weights(EMBEDDING, FEED_FORWARD)),
        ]
    tensors += [
        ("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32)),
        ("output.weight", weights(vocab, EMBEDDING)),
    ]

    # The writer prefixes every model key with its arch, so `kev` gets kev.context_length etc.
    writer = gguf.GGUFWriter(out, architecture)
    try:
        writer.add_name(f"llmgw-tiny-{architecture}")
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        writer.add_context_length(context)
        writer.add_embedding_length(EMBEDDING)
        writer.add_block_count(BLOCKS)
        writer.add_feed_forward_length(FEED_FORWARD)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(HEADS)
        writer.add_rope_dimension_count(EMBEDDING // HEADS)
        writer.add_layer_norm_rms_eps(RMS_EPS)
        writer.add_vocab_size(vocab)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(token_types)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_unk_token_id(UNK_ID)
        for name, data in tensors:
            writer.add_tensor(name, data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devstack.gguf_tiny",
        description="Write a tiny GGUF model (random weights) that llama.cpp loads and runs.",
    )
    parser.add_argument("out", type=Path, help="file to write")
    parser.add_argument("--arch", default="llama", help="general.architecture (e.g. kev to fail loading)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        path = write_tiny_gguf(args.out, architecture=args.arch, seed=args.seed, context=args.context)
    except (ValueError, OSError) as exc:
        print(f"gguf_tiny: {exc}", file=sys.stderr)
        return 2
    print(f"{path} ({path.stat().st_size} bytes, architecture {args.arch})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
