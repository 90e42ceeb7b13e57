"""In-process OOM hook for PyTorch serving processes (vLLM loads it as a general plugin).

Importing this package imports only the standard library: torch, grpc and the
protobuf stubs are imported when the hook is installed or reports, so loading
the plugin costs the host nothing it does not already pay.
"""

from sits_engine.oom_hook.hook import HookConfig, OomHook, install

__all__ = ["HookConfig", "OomHook", "install"]
