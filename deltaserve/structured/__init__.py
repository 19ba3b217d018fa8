"""Structured output: grammars (xgrammar) compiled once per distinct constraint, one matcher per constrained
sequence, and the token bitmasks the sampler applies to the logits (manager.py)."""
