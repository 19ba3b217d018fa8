"""Request lifecycle: scheduling, detokenization, outputs."""
