"""Shared fixtures. torch is imported lazily so tests of torch-free code (daemon clients) stay fast."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Tiny test models gain nothing from intra-op threads, and on a busy machine OpenMP spin-waiting makes them
# up to 100x slower. Set before torch is first imported (test modules import it after conftest); an explicit
# OMP_NUM_THREADS in the environment wins. Subprocesses (daemons under test) inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A developer's own daemon settings (~/.config/m31r/daemon.toml) must not change the daemons under test: the tests
# run with a config home that holds nothing (tests of the settings file make their own).
os.environ["XDG_CONFIG_HOME"] = str(Path(tempfile.gettempdir()) / f"m31r-tests-empty-config-{os.getpid()}")

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs" / "model"
EXIT_GRACE_S = 120


def pytest_unconfigure(config: pytest.Config) -> None:
    """A test run whose process does not exit once the tests are done (a child process or thread it waits for at
    exit) held CI until its 90 minutes ran out, and printed nothing of why: two minutes on, every thread's stack is
    printed and the run fails."""
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.stderr)


@pytest.fixture(scope="session")
def tiny_config():
    """configs/model/tiny.yaml: 2 layers, d_model 64, byte-level vocab of 384, context 512."""
    from m31r.config import load_config

    return load_config(CONFIGS / "tiny.yaml")


@pytest.fixture(scope="session")
def tiny_bundle(tiny_config, tmp_path_factory: pytest.TempPathFactory):
    """A random-weight fp32 bundle (seed 0) of the tiny config. Read-only: copy it before corrupting it."""
    import torch

    from m31r.bundle import init_bundle

    return init_bundle(tiny_config, tmp_path_factory.mktemp("tiny") / "bundle", seed=0, dtype=torch.float32)


@pytest.fixture
def corrupt_bundle(tiny_bundle, tmp_path: Path) -> Path:
    """A copy of the tiny bundle whose weights' last byte is flipped: its checksum no longer matches."""
    import shutil

    bad = tmp_path / "corrupt-bundle"
    shutil.copytree(tiny_bundle.path, bad)
    weights = bad / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    return bad


@pytest.fixture(scope="session")
def tiny_engine(tiny_bundle):
    """An fp32 Engine on the tiny bundle, shared: callers pass their own caches (the default is a fresh one)."""
    from m31r.engine import Engine

    return Engine(tiny_bundle, dtype="float32")


@pytest.fixture(scope="session")
def shared_daemon(tiny_bundle, tmp_path_factory: pytest.TempPathFactory):
    """One real m31rd with the default test options (daemon_util.start_daemon's) on the tiny bundle, shared by the
    modules that only need "a daemon": each start costs a torch import and a model load (~2.5 s of CPU). Its socket
    is in a `run/` folder the daemon created (0700). Tests leave it idle and running; a test that stops, restarts or
    reconfigures a daemon, or counts a daemon's lifetime events, starts its own. Yields the Popen (with
    `log_lines`, lines from every test that used it) and the socket path."""
    from daemon_util import start_daemon, stop_daemon

    sock = tmp_path_factory.mktemp("shared") / "run" / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock)
    yield proc, sock
    stop_daemon(proc)


@pytest.fixture(scope="session")
def release_daemon(tmp_path_factory: pytest.TempPathFactory):
    """One real m31rd on the bundled model (release/), shared as shared_daemon is, for tests of what its answers
    look like to a user. Yields its socket path."""
    from daemon_util import start_daemon, stop_daemon

    sock = tmp_path_factory.mktemp("release") / "run" / "m31rd.sock"
    proc = start_daemon(REPO / "release", sock)
    yield sock
    stop_daemon(proc)
