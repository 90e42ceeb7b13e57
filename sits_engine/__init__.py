"""Code that runs inside the vLLM process: the OOM hook and the scheduler plugin.

It imports only `sits.runtime` (and vLLM/torch), because it is loaded by the
engine, not by a SITS service.
"""
