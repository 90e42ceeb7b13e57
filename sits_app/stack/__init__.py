"""The embedded stack: real components started on one machine for `sits up`, the demo and tests."""
