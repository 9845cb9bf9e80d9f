"""Mixtral (`model_type: mixtral`): `spec.py` (config, weights, KV cache) and `model.py`."""
