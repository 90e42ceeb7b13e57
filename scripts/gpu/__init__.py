"""Scripts for the GPU machine: run each from the repository root as `python3 -m scripts.gpu.<name>`."""
