"""Small random-weight models, written locally, for real SGLang servers on a CPU.

Nothing is downloaded: a ``transformers`` config is built here, the model is
initialised from a seed and saved as safetensors. The same preset and seed
always give the same weights, so two servers (or two runs) started on the
same directory compute the same tokens.

No tokenizer is written: servers run with ``--skip-tokenizer-init`` and
requests carry ``input_ids``. The page hashes HiCache keys its tiers with are
computed over token ids, so sending ids tests exactly the cache path; a
fabricated tokenizer would add a component that only the tokenizer tests
would care about.

Weights are fp32 and not SGLang's ``--load-format dummy``: every KV byte then
matters for the output, so a wrong page shows up as different tokens or
logprobs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

#: Written into the model directory; a directory with the same stamp is reused.
STAMP_FILE = "sglang_simm_tiny_model.json"


@dataclass(frozen=True)
class TinyModel:
    """One preset: a transformers architecture and its sizes."""

    name: str
    architecture: str
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_positions: int = 8192
    #: std of the random init; larger than transformers' 0.02 so that the
    #: logits are not nearly flat (greedy choices then depend on every input)
    init_std: float = 0.1

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.heads

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, fp32 (MHA/GQA)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 4


PRESETS: dict[str, TinyModel] = {
    # the e2e tests: fast to start and to run, 8 KiB of KV per 16-token page per layer
    "llama-tiny": TinyModel("llama-tiny", "llama", 256, 2, 4, 2, 512, 2048),
    # the server demo: prefill of a few thousand tokens costs seconds on 2 cores
    "llama-demo": TinyModel("llama-demo", "llama", 768, 8, 12, 4, 2048, 8192),
}


def _config(preset: TinyModel):
    from transformers import LlamaConfig

    if preset.architecture != "llama":
        raise ValueError(f"unknown architecture {preset.architecture!r}")
    return LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.max_positions,
        initializer_range=preset.init_std,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        dtype="float32",
    )


def write_model(path: str | os.PathLike, preset: str | TinyModel = "llama-tiny", *, seed: int = 0) -> str:
    """Write the model directory (created) for ``preset`` and ``seed``;
    reused as it is when it already holds that preset and seed. Returns the
    directory."""
    model = PRESETS[preset] if isinstance(preset, str) else preset
    path = os.fspath(path)
    stamp = {"preset": asdict(model), "seed": seed, "format": 1}
    stamp_path = os.path.join(path, STAMP_FILE)
    try:
        with open(stamp_path, encoding="utf-8") as f:
            if json.load(f) == stamp and os.path.exists(os.path.join(path, "config.json")):
                return path
    except (OSError, ValueError):
        pass

    import torch
    from transformers import AutoModelForCausalLM

    config = _config(model)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        with torch.no_grad():
            lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(state)
    os.makedirs(path, exist_ok=True)
    lm.save_pretrained(path, safe_serialization=True)
    with open(stamp_path, "w", encoding="utf-8") as f:
        json.dump(stamp, f, indent=2)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("path", help="model directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_model(args.path, args.preset, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
