"""Lossless speculative decoding, by concern (the import-linter contract in pyproject.toml keeps this order):

- `decode.runtime`: how a model runs (the lean forward and its compiled passes, KV caches, CPU kernels, batched
  generation, timing, the choices timed on this machine);
- `decode.sampling`: the warp of the logits and the rejection sampler's draws;
- `decode.models`: the drafts draftops trains (a layer subset of the target, the EAGLE-3 feature draft);
- the algorithm, here: `speculative` (one round, the decoder), `token_tree` (token trees and their walk),
  `generation_stats`, `drafters/` (draft model, prompt lookup, suffix decoding, in chains and trees), `acceptance`,
  `tree_budget_prediction` (a tree's node budget predicted from costs and acceptance) and `tree_budget_measured`
  (`auto`'s inputs, measured where it runs), `step_costs` (the one step-cost timer), and `factory`, where every
  decoder is built;
- `decode.serving`: drafts in and out of serving formats, llama.cpp's server;
- `decode.measure`: eval, bench, the sweep and its report;
- `commands`, `bench_commands`, `cli`: the `draftops decode | eval | bench | sweep | export | llama-cpp | models`
  commands.
"""
