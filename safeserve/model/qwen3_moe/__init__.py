"""Qwen3-MoE (`model_type: qwen3_moe`): `spec.py` (config, weights, KV cache) and `model.py`."""
