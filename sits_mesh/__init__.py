"""SITS mesh: Envoy and Istio configs from one policy, the admission external processor, Envoy as a process."""
