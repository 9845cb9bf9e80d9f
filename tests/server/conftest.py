"""The server of the HTTP API tests (test_http_api.py, test_http_errors.py): a checkpoint
written by `transformers`, served by a real process with a key; one server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from checkpoints import write_qwen3_moe_checkpoint
from serving import API_KEY as KEY
from serving import API_MODEL as MODEL
from serving import Server, start_server, stop_server


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A long context so that a long generation can be cut off by a disconnect.
    return write_qwen3_moe_checkpoint(
        tmp_path_factory.mktemp("http"), seed=11, max_position_embeddings=4096
    )


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("log") / "server.log"
    s = start_server(
        [
            "--model",
            str(ckpt),
            "--served-model-name",
            MODEL,
            "--api-key",
            KEY,
            "--chunked-prefill-size",
            "8",
            "--max-num-batched-tokens",
            "64",
            "--max-model-len",
            "2048",
            "--max-request-body-bytes",
            "65536",
        ],
        log,
    )
    yield s
    stop_server(s.proc)
