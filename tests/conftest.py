"""Fixtures every test file shares: the session's scratch folder, the environment a chapter's processes run in,
the training runs several files compare against (chapter 01's reference runs above all), and the tied tiny model.

The helpers that are plain functions (train(), run(), read_losses(), ...) live in helpers.py.
"""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from helpers import TINY_MODEL, SharedRuns, processes_with_marker

WARM_START = Path(__file__).resolve().parent / "warm_start"


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("session")


def session_environment(session_dir):
    """Offline, with caches under the session's folder; the tokenized data cache (HF_HOME) is shared by the whole
    session, so the corpus is tokenized once."""
    return {
        **os.environ,
        "HF_HOME": str(session_dir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(session_dir / "wandb"),
        "WANDB_CONFIG_DIR": str(session_dir / "wandb-config"),
        "WANDB_CACHE_DIR": str(session_dir / "wandb-cache"),
        "WANDB_DATA_DIR": str(session_dir / "wandb-data"),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(WARM_START),
    }


@pytest.fixture(scope="session")
def warm_start(session_dir):
    """The warm-start server (warm_start/server.py) for the session: {"WARM_START_SOCKET": path} for the processes'
    environment, or {} when WARM_START=0 asks for every process to start cold."""
    if os.environ.get("WARM_START") == "0":
        yield {}
        return
    socket_path = str(session_dir / "warm.sock")
    environment = {**session_environment(session_dir), "WARM_START_SOCKET": socket_path}
    log = open(session_dir / "warm-start.log", "w")
    server = subprocess.Popen([sys.executable, WARM_START / "server.py", socket_path], env=environment,
                              stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    ready = server.stdout.readline().strip()
    assert ready == "ready", f"the warm-start server did not start: {(session_dir / 'warm-start.log').read_text()}"
    yield {"WARM_START_SOCKET": socket_path}
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.fixture
def env(session_dir, warm_start):
    """The environment for a chapter's processes (session_environment), with the warm-start server and a marker."""
    marker = uuid.uuid4().hex
    environment = {**session_environment(session_dir), **warm_start, "TEST_PROCESS_MARKER": marker}
    yield environment
    assert not processes_with_marker(marker), "the test left processes running"


@pytest.fixture(scope="session")
def tied_model(session_dir):
    """The bundled tiny model with tie_word_embeddings true: one matrix is both the input embedding and the output
    head, as in Llama 3.2 1B and 3B and the small Qwen2.5 models."""
    folder = session_dir / "tiny-llama-tied"
    if not folder.exists():
        shutil.copytree(TINY_MODEL, folder)
        config = json.loads((folder / "config.json").read_text())
        config["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The runs several tests compare against, each made once per session when a test first asks for it: chapter
    01's reference runs, and a chapter's runs that several of its tests read (SharedRuns)."""
    return SharedRuns(tmp_path_factory.mktemp("runs"))
