"""Measuring decoders: eval, bench, the sweep and its report, quantized and batched comparisons."""
