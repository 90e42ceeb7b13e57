"""The demo: real vLLM behind Envoy, driven past what it can serve, healed live by SITS."""
