"""Turns scheduled sequences into model forwards and sampled tokens."""
