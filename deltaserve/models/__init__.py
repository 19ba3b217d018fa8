"""Model definitions and the checkpoint loader."""
