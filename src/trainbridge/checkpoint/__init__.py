"""Checkpoints: atomic HF-layout folders, rotation, resume state."""
