"""The demo and the tiny local models and data it (and the tests) use."""
