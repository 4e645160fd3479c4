"""Reports on finished runs, read from what they left on disk (``trainbridge plot``)."""
