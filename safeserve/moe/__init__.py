"""The MoE layer as five stages: router, dispatch, experts, combine (see DESIGN.md)."""
