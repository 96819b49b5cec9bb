"""Lossless speculative decoding, its drafters, statistics and analytic acceptance."""

from decode.factory import build_decoder
from decode.speculative import GammaPolicy, GenerationResult, SpeculativeDecoder
from decode.stats import GenerationStats

__all__ = ["GammaPolicy", "GenerationResult", "GenerationStats", "SpeculativeDecoder", "build_decoder"]
