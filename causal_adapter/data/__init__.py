"""Layer 4, data: the text -> <NUM> pipeline and the bundled corpora."""
