"""Model building blocks. Layers read per-sequence state through the ForwardBatch and CacheBuffers
they are given and call ops through the Kernels chosen at build time; they never import Triton."""
