"""Lossless speculative decoding: drafters, the decoder and its factory (`decode.factory.build_decoder`), the runtime
that runs the models, statistics, analytic acceptance, and the eval, bench and sweep commands."""
