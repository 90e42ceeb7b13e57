"""The app layer: the `sits` CLI, the embedded stack, the demo and the fleet simulator.

It wires the services, the mesh and the engine plugins together; nothing below imports it.
"""
