from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import interpreter_numerics  # noqa: E402
from checkpoints import write_qwen3_moe_checkpoint  # noqa: E402
from serving import Server, start_server, stop_server  # noqa: E402

interpreter_numerics.apply()  # TRITON_INTERPRET=1 runs only


def pytest_addoption(parser: pytest.Parser) -> None:
    # For `make test`'s interpreter run: its tests skip, not fail, where Triton is missing, so a
    # run that only skipped would otherwise pass.
    parser.addoption(
        "--min-passed",
        type=int,
        default=0,
        metavar="N",
        help="fail the run when fewer than N tests passed (default 0: no check)",
    )


def pytest_report_header(config: pytest.Config) -> str:
    from seeds import OFFSET

    return f"test seed offset: {OFFSET} (SAFESERVE_TEST_SEED; 0 when unset)"


_passed = 0  # tests passed in this session, for --min-passed


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller counts
        return
    want = session.config.getoption("min_passed")
    if session.exitstatus == pytest.ExitCode.OK and _passed < want:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    want = config.getoption("min_passed")
    if _passed < want:
        terminalreporter.write_line(
            f"FAILED --min-passed={want}: {_passed} test(s) passed, the rest skipped or failed",
            red=True,
        )


# Tests here start servers, kill and stop processes, or time detection and recovery: `make test`
# runs them one at a time (`serial`), and everything else on two workers before them.
SERIAL_DIRS = ("server", "guards", "oncall", "chaos", "deploy")
TESTS = Path(__file__).resolve().parent


def _serial(item: pytest.Item) -> bool:
    parts = item.path.resolve().relative_to(TESTS).parts
    return (
        parts[0] in SERIAL_DIRS
        or "slow" in item.keywords
        or "server_factory" in getattr(item, "fixturenames", ())
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _serial(item):
            item.add_marker(pytest.mark.serial)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default small random Qwen3-MoE checkpoint with a BPE tokenizer and chat template."""
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=0)


@pytest.fixture
def batch_invariant_kernels() -> Iterator[None]:
    """The kernel entry points in batch-invariant mode (--enable-deterministic-inference) for
    the test, as the model runner sets them."""
    from safeserve.kernels import common

    common.set_batch_invariant(True)
    yield
    common.set_batch_invariant(False)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test: tiny GEMMs on a shared host spend more in OpenMP
    barriers than they split."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator:
    started: list[subprocess.Popen] = []

    def make(args: list[str], **kw: object) -> Server:
        s = start_server(args, tmp_path / f"server{len(started)}.log", **kw)
        started.append(s.proc)
        return s

    yield make
    for p in started:
        stop_server(p)
