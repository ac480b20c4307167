"""Embedded model shapes for the engine benchmarks: a config.json and dummy weights, no download."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

_QWEN3_COMMON = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "sliding_window": None, "use_sliding_window": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 151936,
}

MODELS: dict[str, dict] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "max_window_layers": 28, "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
        "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
        "max_window_layers": 36, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "max_window_layers": 48, "tie_word_embeddings": False,
    },
}


def model_dir(name: str, root: str | Path | None = None) -> Path:
    """A directory holding ``name``'s config.json, for ``load_format="dummy"`` engines."""
    if name not in MODELS:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(MODELS)}")
    base = Path(root) if root is not None else Path(tempfile.gettempdir()) / "bcg-models"
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODELS[name], indent=2))
    return path


def shape_summary(name: str) -> dict:
    """The fields a result file records about the model."""
    c = MODELS[name]
    keys = ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "num_experts_per_tok"]
    return {"name": name, "dummy_weights": True, "dtype": "bfloat16", **{k: c[k] for k in keys if k in c}}
