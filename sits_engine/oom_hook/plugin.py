"""vLLM general-plugin entry point (`vllm.general_plugins`: `sits_oom_hook`).

vLLM calls `register()` in every process it starts (API server, engine core,
workers). Configuration comes from SITS_OOM_HOOK_* variables (see
`HookConfig.from_env`); SITS_OOM_HOOK_DISABLED=1 turns the hook off.
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("sits.oom_hook")


def register() -> None:
    if os.environ.get("SITS_OOM_HOOK_DISABLED", "") in ("1", "true", "yes"):
        return
    try:
        from sits_engine.oom_hook.hook import install

        hook = install()
        log.info("sits oom hook: %s", hook.status)
    except Exception:
        # A plugin that raises stops vLLM from starting; the hook is never worth that.
        with contextlib.suppress(Exception):
            log.exception("sits oom hook could not be installed; the engine runs without it")
