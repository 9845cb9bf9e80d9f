"""How a group's ranks are laid out (`layout.py`: tensor/expert/data-parallel ranks, torch-free)
and how they talk (`comm.py`: the group's process groups and collectives)."""
