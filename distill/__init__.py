"""Distill a small draft model from the target's own distribution: init, data, losses, the accelerate loop, export."""
