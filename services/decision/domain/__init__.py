"""Pure domain of the decision service: windows, forecasts, root causes, policy, decisions.

No Kafka, gRPC, Redis or file I/O here; time comes from an injected clock.
"""
