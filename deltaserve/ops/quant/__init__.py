"""Weight quantization formats the ops accept: block-FP8 (fp8.py)."""
