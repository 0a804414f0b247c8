"""In-tree backends. Each registers through the ``lmport.backends`` entry-point group."""
