"""How draftops runs a model: the lean forward and its CPU kernels, caches, batched generation, timing, and the
choices timed on this machine (`machine_choice`)."""
