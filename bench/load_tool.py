"""AIPerf, the field's load generator for the HTTP path, in a virtualenv of its own.

Why AIPerf: of the three tools the issue names, inference-perf has no release
for this machine's Python 3.11, and GuideLLM pulls a CUDA PyTorch (6 GB) unless
it shares the project's; AIPerf 0.13 installs alone (no PyTorch, 1.2 GB) and
drives vLLM's OpenAI API with streaming, per-request headers (the tier) and a
local tokenizer, and writes its own JSON/CSV exports. Its own virtualenv keeps
its pins (transformers, pydantic, zmq) out of the project's.

`ensure_aiperf()` installs it from the package registry on first use (a few
minutes) and returns the `aiperf` command. A host without the registry (the GPU
device machine, scripts/gpu/overload_http_gpu.sh) installs it from carried wheels
itself and names the command in `SITS_AIPERF_COMMAND`, which is then used as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AIPERF_VERSION = "0.13.0"
VENV = ROOT / ".cache" / "aiperf-venv"
# An `aiperf` command installed beforehand (AIPERF_VERSION), used instead of the virtualenv: no install.
COMMAND_ENV = "SITS_AIPERF_COMMAND"


def aiperf_command(venv: Path = VENV) -> Path:
    return venv / "bin" / "aiperf"


def installed_version(venv: Path = VENV) -> str | None:
    python = venv / "bin" / "python"
    if not python.exists():
        return None
    result = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('aiperf'))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def ensure_aiperf(venv: Path = VENV) -> Path:
    """The `aiperf` command, installed (pinned) into `venv` first when it is not there, or the one
    `SITS_AIPERF_COMMAND` names."""
    given = os.environ.get(COMMAND_ENV)
    if given:
        if not Path(given).is_file():
            raise RuntimeError(f"{COMMAND_ENV}={given}: no such command")
        return Path(given)
    if installed_version(venv) == AIPERF_VERSION:
        return aiperf_command(venv)
    print(f"installing aiperf {AIPERF_VERSION} into {venv} (first run: a few minutes)", flush=True)
    if not (venv / "bin" / "python").exists():
        # The project's interpreter makes the venv (AIPerf supports Python 3.11-3.13).
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"aiperf=={AIPERF_VERSION}"], check=True
    )
    if installed_version(venv) != AIPERF_VERSION:
        raise RuntimeError(f"aiperf {AIPERF_VERSION} did not install into {venv}")
    return aiperf_command(venv)


if __name__ == "__main__":
    print(ensure_aiperf())
