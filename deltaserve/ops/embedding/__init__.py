"""See reference.py for the math and layouts; triton.py (where present) implements the same signatures."""
