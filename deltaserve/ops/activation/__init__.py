"""See reference.py for the math; triton.py implements the same signatures."""
