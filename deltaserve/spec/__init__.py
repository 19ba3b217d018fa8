"""Speculative decoding pieces: the user's config, the n-gram drafter, adaptive K (no torch: the scheduler
imports these) and lossless rejection sampling (torch, runner side: import deltaserve.spec.rejection)."""
