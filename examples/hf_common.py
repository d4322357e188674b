"""Shared by examples/generate.py and examples/finetune_hf.py: a random starter checkpoint and
the checkpoint's tokenizer (``tokenizers`` on ``tokenizer.json``; UTF-8 bytes without one)."""

from __future__ import annotations

from pathlib import Path

from flax import nnx

from gdn_jax.convert import save_hf_model
from gdn_jax.models import HybridLM, get_config

# A 4-layer Qwen3.5-style hybrid (3 GDN + 1 attention layer) over byte ids: runs on a CPU.
RANDOM_CONFIG = dict(vocab_size=256, zero_centered_norm=True, tie_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def random_checkpoint(path: Path, *, seed: int = 0, num_layers: int = 4) -> Path:
    """Write a randomly initialised HF checkpoint (``Qwen3_5ForCausalLM`` layout) to ``path``:
    ``num_layers`` layers, every 4th (or the last of 2-3) softmax attention, the rest GDN."""
    interval = min(4, num_layers)
    config = get_config(
        "tiny", num_layers=num_layers, full_attention_interval=interval, **RANDOM_CONFIG
    )
    # One compiled initialisation instead of an op-by-op one (the same values).
    model = nnx.jit(lambda: HybridLM(config, rngs=nnx.Rngs(seed)))()
    save_hf_model(model, path)
    return path


class Tokenizer:
    """``encode(text) -> ids`` / ``decode(ids) -> text`` of a checkpoint directory."""

    def __init__(self, model_dir: Path, vocab_size: int):
        file = Path(model_dir) / "tokenizer.json"
        self.hf = None
        if file.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.hf = HFTokenizer.from_file(str(file))
        elif vocab_size < 256:
            raise ValueError(
                f"{model_dir} has no tokenizer.json and vocab_size={vocab_size} < 256: "
                "cannot use UTF-8 bytes as token ids"
            )
        self.name = "tokenizer.json" if self.hf else "UTF-8 bytes (no tokenizer.json)"

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return self.hf.encode(text).ids
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.hf is not None:
            return self.hf.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of a checkpoint next to a saved one."""
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.is_file():
            (Path(dst) / name).write_bytes(f.read_bytes())
