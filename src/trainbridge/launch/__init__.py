"""Launching: run_training, the torchrun worker entry point, the callback transport and assembly."""
