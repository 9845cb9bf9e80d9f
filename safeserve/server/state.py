"""The server's state, one per process: its arguments, the model's config and tokenizer, the
metrics, each group's supervisor, the router over them and the generator.

The routes, the admin API, intake and the responses read it; the lifespan in `startup.py` fills
in the supervisors, the router, the generator and the admin server when the app starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from safeserve.config import ServerArgs
from safeserve.model.checkpoint import load_model_config
from safeserve.model.tokenizer import Tokenizer, load_tokenizer
from safeserve.server.generate import Generator
from safeserve.server.group_client import GroupClient
from safeserve.server.metrics import Metrics
from safeserve.server.nodes import NodeHub
from safeserve.server.router import GroupRouter
from safeserve.server.supervisor import Supervisor


class ServerState:
    @property
    def groups(self) -> list[GroupClient]:
        """The current incarnation of every group."""
        return [s.client for s in self.supervisors if s.client is not None]

    def __init__(self, args: ServerArgs, on_fatal: Callable[[str], None]) -> None:
        self.args = args
        self.model_config = load_model_config(args.model)
        self.tokenizer: Tokenizer = load_tokenizer(
            args.model, self.model_config.eos_token_ids, args.load_format == "dummy"
        )
        self.metrics = Metrics()
        self.on_fatal = on_fatal
        self.supervisors: list[Supervisor] = []
        self.router: GroupRouter | None = None
        self.hub: NodeHub | None = None  # --placement remote: the node agents
        self.admin_server: Any = None
        self.generator: Generator | None = None
        self.started = time.time()
