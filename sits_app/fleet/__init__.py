"""A simulated fleet of GPUs publishing through capture's own publisher (`sits fleet`)."""
