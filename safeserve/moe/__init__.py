"""The MoE layer as five stages: router, dispatch, experts, combine (one module each)."""
