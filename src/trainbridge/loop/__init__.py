"""The training loop and the result it reports."""
