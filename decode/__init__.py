"""Lossless speculative decoding, its statistics and analytic acceptance."""

from decode.speculative import AdaptiveGamma, GenerationResult, SpeculativeDecoder
from decode.stats import GenerationStats

__all__ = ["AdaptiveGamma", "GenerationResult", "GenerationStats", "SpeculativeDecoder"]
