"""Developer and GPU-machine scripts: run each from the repository root as `python -m scripts.<name>`."""
