"""Sampling ops: drawing a token per row from the tempered softmax by inverse CDF."""
