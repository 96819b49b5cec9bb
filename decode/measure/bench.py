"""`draftops bench`: target-only greedy vs HF assisted generation vs this decoder on the same prompts.

Every row (`target_only`, `target_only_torch`, `plain`, `hf_assisted`, `speculative`, each source alone, chain rounds,
`--compare` rows, llama.cpp's where it is built) decodes the same prompts, interleaved prompt by prompt
(`decode.runtime.timing.run_interleaved`); the step costs c and v are measured apart and from the run's own timings, to
compare the speedup with Leviathan's prediction and the overhead-free bound. It is apart from `draftops sweep`, which
predicts speedups over a grid: bench measures the decoder users run. The rows: docs/guide.md#benchmark-make-bench.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from decode.acceptance import break_even_alpha, expected_speedup
from decode.chain_acceptance import ENGINE_CHAIN, chain_summary, greedy_chains
from decode.drafters.chain import output_size
from decode.drafters.lookup import lookup_max_ngram
from decode.drafters.protocol import DECODER, LOOKUP
from decode.drafters.tree_drafter import TreeDrafter
from decode.factory import build_decoder
from decode.generation_stats import aggregate_stats
from decode.measure.bench_llamacpp import llama_cpp_rows, llama_cpp_summary
from decode.measure.bench_rows import (
    CHAIN,
    CHALLENGER_ROWS,
    DRAFT_ONLY_CHAIN,
    PLAIN_EAGER,
    SOURCE_ROWS,
    TARGET_ONLY,
    TARGET_ONLY_TORCH,
    challenger_rows,
    decoder_rows,
    describe_trees,
    draft_alpha_row,
)
from decode.models.feature_draft import FeatureDraft
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.kernels import cpu_linear_of, torch_kernels
from decode.runtime.lean import compiled_lean
from decode.runtime.timing import run_interleaved
from decode.serving.llamacpp import Completion, LlamaServer
from decode.serving.loading import hf_assistant_model
from decode.step_costs import costed_drafter, step_costs
from pipeline.config import DecodeConfig
from pipeline.intervals import paired_speedup, ratio_ci
from pipeline.sources import HF_ASSISTANT_DIR, eos_token_ids


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.inference_mode()
def hf_generate(model, prompt: list[int], *, max_new_tokens: int, eos_ids: list[int], pad_id: int,
                assistant=None, gamma: int | None = None, lookup_ngram: int | None = None) -> list[int]:
    """HF greedy `generate`, optionally with assisted generation (γ constant, no confidence early-exit) or with
    HF's prompt lookup decoding (γ tokens from n-grams of up to `lookup_ngram` tokens)."""
    ids = torch.tensor([prompt], device=_device(model))
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids or None, pad_token_id=pad_id,
                  attention_mask=torch.ones_like(ids))
    if assistant is not None:
        # HF's candidate generator reads these from the assistant's own generation config.
        assistant.generation_config.num_assistant_tokens = gamma
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs.update(assistant_model=assistant, num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant")
    if lookup_ngram is not None:
        kwargs.update(prompt_lookup_num_tokens=gamma, max_matching_ngram_size=lookup_ngram)
    return model.generate(ids, **kwargs)[0, len(prompt):].tolist()


def in_run_costs(stats: Sequence, target_only: dict) -> dict[str, float]:
    """c, v and the overhead-free bound from the timings of the run itself, at the contexts the prompts really had.

    The isolated `step_costs` are taken at the first prompt's context; the run's verify passes and draft steps meet
    longer contexts, and a draft round's first step feeds two tokens. Here one target step is plain decoding's seconds
    per token (its prefill included) in `target_only`, the bench's baseline row; c is the decoder's draft seconds per
    draft call and v its verify seconds per target call, both over that step, and the bound counts only model time
    (prefill, draft, verify). So speedup / bound is the share of the decoder's time spent in the models: 1 minus its
    own bookkeeping share. A model-free decoder (prompt lookup, suffix decoding) makes no draft calls: its c is 0, and
    the time its proposals take stays in the bound as draft seconds.
    """
    step = target_only["seconds"] / max(1, target_only["new_tokens"])
    draft_calls, target_calls = sum(s.draft_calls for s in stats), sum(s.target_calls for s in stats)
    model_s = sum(s.prefill_s + s.draft_s + s.verify_s for s in stats)
    total_s = sum(s.total_s for s in stats)
    return {
        "target_step_s": step,
        "c": sum(s.draft_s for s in stats) / draft_calls / step if draft_calls else 0.0,
        "v": sum(s.verify_s for s in stats) / max(1, target_calls) / step,
        "drafts_per_round": draft_calls / max(1, target_calls),
        "overhead_free_bound": target_only["seconds"] / model_s if model_s else float("nan"),
        "model_time_share": model_s / total_s if total_s else float("nan"),
    }


def hf_generate_on_torch_kernels(model, prompt: list[int], **kwargs) -> list[int]:
    """`hf_generate` with the model's linear layers on torch's stock kernels for the call (`decode.runtime.kernels`)."""
    with torch_kernels(model):
        return hf_generate(model, prompt, **kwargs)


def strongest_baseline(results: dict) -> str:
    """The target-only row with the most tokens per second: the denominator of every speedup, so that draftops'
    kernels cannot make its own denominator slow. llama.cpp's rows decode another (quantized) model and are no
    candidate: its speculative row is compared with its own target-only row (`llama_cpp_summary`)."""
    return max((name for name in (TARGET_ONLY, TARGET_ONLY_TORCH) if name in results),
               key=lambda name: results[name]["tokens_per_s"]["value"])


def method_results(outputs: dict, seconds: dict, seed: int) -> tuple[dict, str]:
    """Per method: tokens, seconds, tokens/s, outputs equal to target_only's, and (all but the baseline) the paired
    speedup against the strongest baseline; and that baseline's name."""
    tokens = {name: [len(o) for o in outs] for name, outs in outputs.items()}
    results = {}
    for name in seconds:
        results[name] = {
            "new_tokens": int(sum(tokens[name])),
            "seconds": float(sum(seconds[name])),
            "tokens_per_s": ratio_ci(tokens[name], seconds[name], seed=seed).to_dict(),
            "same_output_as_target": sum(o == t for o, t in zip(outputs[name], outputs[TARGET_ONLY])),
        }
    baseline = strongest_baseline(results)
    for name in seconds:
        if name != baseline:
            results[name]["speedup"] = paired_speedup(
                tokens[name], seconds[name], tokens[baseline], seconds[baseline], seed=seed)
    return results, baseline


def decoder_summary(stats: Sequence, categories: Sequence[str], seed: int) -> dict:
    """A decoder row's acceptance, τ and accepted tokens by tree source."""
    summary = aggregate_stats(stats, categories, seed=seed)
    return {key: summary[key] for key in ("acceptance_rate", "tau", "accepted_by_source", "acceptance_at_position")}


def run_bench(target, draft, prompts: Sequence[list[int]], categories: Sequence[str], decode: DecodeConfig, *,
              gamma: int | None = None, seed: int = 0, progress: bool = True,
              llama_cpp: dict[str, LlamaServer] | None = None, compare: dict[str, DecodeConfig] | None = None,
              challenger=None, chain_k: int = ENGINE_CHAIN) -> dict:
    """target is a `pipeline.sources.ResolvedModel`, draft one too, or None to bench prompt lookup alone. Greedy
    throughout; `decode` (cfg.decode) describes the decoder, `gamma` overrides its γ policy with a fixed γ; the rows
    of `decoder_rows` run beside it. `compare`: more decoders to run beside it by row name (their own decode
    settings, same drafter kind). `progress`: a bar over the prompts on stderr. `llama_cpp`: started llama.cpp
    servers for the rows LLAMA_CPP_TARGET_ONLY and LLAMA_CPP_SPECULATIVE (`decode.serving.llamacpp`), run interleaved
    with the others on the same token ids. With `decode.compiled`, every draftops row runs compiled passes (compiled in
    the untimed warm-up run) and a `plain_eager` row runs plain greedy decoding through the eager lean forward, so
    that what compiling gains and what speculation gains stay apart. `challenger`: a second draft (a
    `ResolvedModel`) run in the rows of `challenger_rows`, its step costs and its own acceptance reported beside the
    draft's (`report["challenger"]`). `chain`: the draft's acceptance by position in chains of `chain_k` drafts and
    their mean acceptance length, over the target's greedy text, as vLLM counts them (`decode.chain_acceptance`).

    With a γ schedule or adaptive γ, this decoder follows it; HF assisted generation and the cost model use its γ.
    """
    decode = decode.model_copy(update={"temperature": 0.0})
    rows, second, decoders = bench_decoders(target, draft, decode, gamma, compare, challenger)
    decoder = decoders["speculative"]
    methods, notes = target_only_methods(target, decoder, decode)
    for name, d in decoders.items():
        methods[name] = (lambda d: lambda p: d.generate(p, max_new_tokens=decode.max_new_tokens))(d)
    notes += decoder_notes(decode, target, draft, decoders, second, challenger, compare)
    methods.update(reference_methods(target, draft, decode, decoder.gamma.gamma, notes))
    completions: dict[str, list[Completion]] = {}
    if llama_cpp:
        methods.update(llama_cpp_rows(llama_cpp, decode.max_new_tokens, completions))
        notes.append("llama_cpp rows: llama.cpp's server on the target's GGUF as llama.cpp runs it (its own quantized "
                     "kernels, so its greedy text may differ from the float32 target's), alone and with the exported "
                     f"draft (GGUF, draft-simple, up to γ={decoder.gamma.gamma} tokens a round, no prompt lookup)")
    device = _device(target.model)
    for run in methods.values():  # warm-up
        run(prompts[0])
    runs = run_interleaved(methods, tqdm(prompts, desc="bench", unit="prompt", disable=not progress), device)
    stats = {name: [result.stats for result in runs.outputs[name]] for name in decoders}
    outputs = {**runs.outputs, **{name: [result.token_ids for result in runs.outputs[name]] for name in decoders}}
    results, baseline = method_results(outputs, runs.seconds, seed)
    report = {
        "n_prompts": len(prompts),
        "settings": {**decoder.gamma.to_dict(), "max_new_tokens": decode.max_new_tokens, "greedy": True,
                     "device": str(device), "cpu_linear": cpu_linear_of(target.model),
                     **({"lookup_min_ngram": decode.lookup_min_ngram} if draft is None or len(decoders) > 1 else {}),
                     **({"draft_min_confidence": decode.draft_min_confidence} if draft is not None else {})},
        "drafters": {name: d.drafter.name for name, d in decoders.items()},
        "methods": results,
        "baseline": baseline,
        **acceptance_and_costs(decoder, target, prompts, stats, categories, rows, results[baseline], seed),
        "decoders": {name: decoder_summary(stats[name], categories, seed) for name in decoders},
        "llama_cpp": llama_cpp_summary(outputs, runs.seconds, completions, seed) if llama_cpp else None,
        "chain": text_chains(target, draft, prompts, outputs[TARGET_ONLY], chain_k, seed),
        "challenger": challenger_report(challenger, second, decoder, decoders, target, prompts, stats, categories,
                                        outputs, runs.seconds, seed, chain_k) if second else None,
        **paired_comparisons(outputs, runs.seconds, decoders, compare, seed),
        "notes": notes,
    }
    return report


def bench_decoders(target, draft, decode: DecodeConfig, gamma: int | None, compare: dict | None, challenger):
    """The rows of `decoder_rows`, the challenger's rows and the decoders of both and of --compare, each built by the
    factory from its own decode settings."""
    rows = decoder_rows(decode, draft is not None)
    decoders = {name: build_decoder(target, draft, row_decode, kind=kind, gamma=gamma)
                for name, (row_decode, kind) in rows.items()}
    for name, variant in (compare or {}).items():
        if variant.compiled != decode.compiled:
            raise ValueError(f"compared row {name}: decode.compiled holds for the whole run (a model's passes are "
                             f"compiled for the process); with it on, the {PLAIN_EAGER} row is the eager forward")
        decoders[name] = build_decoder(target, draft, variant.model_copy(update={"temperature": 0.0}),
                                       kind=LOOKUP if draft is None else DECODER, gamma=gamma)
    second = challenger_rows(rows) if challenger is not None else {}
    if second and draft is None:
        raise ValueError("a challenger draft is compared with a draft model, not with prompt lookup alone")
    decoders.update({name: build_decoder(target, challenger, row_decode, kind=kind, gamma=gamma)
                     for name, (row_decode, kind) in second.items()})
    return rows, second, decoders


def _greedy_settings(target, decode: DecodeConfig) -> dict:
    eos = eos_token_ids(target.model, target.tokenizer)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else (eos or [0])[0]
    return dict(max_new_tokens=decode.max_new_tokens, eos_ids=eos, pad_id=pad)


def target_only_methods(target, decoder, decode: DecodeConfig) -> tuple[dict[str, Callable], list[str]]:
    """The rows without a draft: HF `generate` on draftops' kernels and (where they differ) torch's, `plain`
    greedy decoding through the decoder's own target forward and, with compiled passes, `plain_eager`."""
    common = _greedy_settings(target, decode)
    eos, max_new_tokens = common["eos_ids"], decode.max_new_tokens
    methods: dict[str, Callable[[list[int]], object]] = {TARGET_ONLY: lambda p: hf_generate(target.model, p, **common)}
    if cpu_linear_of(target.model) != "torch":
        methods[TARGET_ONLY_TORCH] = lambda p: hf_generate_on_torch_kernels(target.model, p, **common)
    methods["plain"] = lambda p: greedy_decode(decoder.target_runner, p, max_new_tokens, eos)
    notes = []
    if decode.compiled and compiled_lean(target.model) is None:  # no lean forward for it: every row runs eager
        notes.append(f"decode.compiled does not apply to this {target.model.config.model_type} target: every row "
                     "runs its passes eagerly, through transformers' forward")
    elif decode.compiled:
        eager_runner = ModelRunner(target.model, compiled=False)
        methods[PLAIN_EAGER] = lambda p: greedy_decode(eager_runner, p, max_new_tokens, eos)
        notes.append(f"decode.compiled: plain and the speculative rows run the target's and the draft's passes "
                     f"compiled (torch.compile, compiled in the warm-up run, not timed); {PLAIN_EAGER}: plain through "
                     "the eager lean forward")
    return methods, notes


def decoder_notes(decode: DecodeConfig, target, draft, decoders: dict, second: dict, challenger,
                  compare: dict | None) -> list[str]:
    """What each decoder row is, in words, for the report's notes."""
    notes = [f"speculative: {describe_trees(decode, target, draft)}"]
    halves = [name for name in SOURCE_ROWS.values() if name in decoders]
    if halves:
        first = ([] if decode.lookup_min_ngram is None
                 else [f"prompt-lookup proposals (n-grams of >= {decode.lookup_min_ngram} tokens)"])
        first += ["suffix decoding's candidates"] if decode.suffix_decoding else []
        notes.append(f"this decoder takes {' and '.join(first)} first"
                     + (", the draft model elsewhere" if draft is not None else "")
                     + f"; {', '.join(halves)}: each source alone"
                     + ("; HF assisted generation uses the draft model only" if draft is not None else ""))
    if CHAIN in decoders:
        notes.append(f"{CHAIN}: this decoder in chain rounds (no tree, no suffix decoding), what tree_budget 0 runs"
                     + (f"; {DRAFT_ONLY_CHAIN}: the draft model alone in chain rounds" if DRAFT_ONLY_CHAIN in decoders
                        else ""))
    if second:
        notes.append(f"challenger rows ({', '.join(second)}): the rows of the same names without the prefix, with "
                     f"the challenger draft {challenger.source} in place of the draft")
    if compare:
        notes.append("compared decoders (--compare): " + "; ".join(
            f"{name}: {describe_trees(variant, target, draft)}" for name, variant in compare.items()))
    policy = decoders["speculative"].gamma
    if draft is not None and decode.draft_min_confidence is not None:
        notes.append(f"the draft model ends a block where its top probability is below {decode.draft_min_confidence}; "
                     f"the cost model assumes γ={policy.gamma} drafts a round, the in-run costs count the real ones")
    if policy.kind != "fixed":
        notes.append(f"this decoder follows the {policy.kind} γ policy {policy.to_dict()}; "
                     f"HF assisted and the cost model use γ={policy.gamma}")
    return notes


def reference_methods(target, draft, decode: DecodeConfig, gamma: int, notes: list[str]) -> dict[str, Callable]:
    """transformers' own speculation on the same prompts: assisted generation with the draft, or its prompt lookup
    where there is no draft model (up to the n-gram length this decoder's lookup matches first)."""
    common = _greedy_settings(target, decode)
    if draft is None:
        ngram = lookup_max_ngram(decode.lookup_min_ngram)
        return {"hf_prompt_lookup": lambda p: hf_generate(target.model, p, gamma=gamma, lookup_ngram=ngram, **common)}
    if isinstance(draft.model, FeatureDraft):
        notes.append("no hf_assisted row: transformers' assisted generation cannot run a feature draft (it reads the "
                     "target's hidden states, which assisted generation does not hand to an assistant model)")
        return {}
    assistant = hf_assistant_model(draft)
    if draft.token_ids is not None:
        notes.append(f"HF assisted generation uses the draft's full-vocabulary copy ({HF_ASSISTANT_DIR}/): "
                     "transformers cannot use a reduced-vocabulary head")
    return {"hf_assisted": lambda p: hf_generate(target.model, p, assistant=assistant, gamma=gamma, **common)}


def acceptance_and_costs(decoder, target, prompts, stats: dict, categories, rows: dict, baseline: dict,
                         seed: int) -> dict:
    """The decoder's α and τ, the draft's own α, the isolated and in-run step costs, Leviathan's prediction and the
    overhead-free bound."""
    gamma = decoder.gamma.gamma
    tree_budget = decoder.drafter.budget_at(len(prompts[0])) if isinstance(decoder.drafter, TreeDrafter) else 0
    costs = step_costs(decoder.target_runner, costed_drafter(decoder.drafter, output_size(target.model)),
                       prompts[0], gamma, tree_budget=tree_budget)
    summary = aggregate_stats(stats["speculative"], categories, seed=seed)
    alpha, tau = summary["acceptance_rate"]["value"], summary["tau"]["value"]
    in_run = in_run_costs(stats["speculative"], baseline)
    if tree_budget:  # a tree round: its draft forwards as the run made them, one tree verify; Leviathan's is a chain's
        predicted, bound = None, tau / (in_run["drafts_per_round"] * costs["c"] + costs["v_tree"])
    else:
        predicted = expected_speedup(alpha, gamma, costs["c"], costs["v"])
        bound = tau / (gamma * costs["c"] + costs["v"])
    draft_run = draft_alpha_row(rows)
    draft_summary = aggregate_stats(stats[draft_run], categories, seed=seed) if draft_run else None
    # The monitor holds the draft's own chain acceptance against this break-even: the draft alone in chains gives
    # its costs, whether or not the decoder kept the draft (left out, the decoder's c would be 0)
    even_row, even = (draft_run, in_run_costs(stats[draft_run], baseline)) if draft_run else ("speculative", in_run)
    return {
        "alpha": summary["acceptance_rate"],
        "alpha_draft": draft_summary["acceptance_rate"] if draft_summary else None,
        # the draft model alone: acceptance at each draft position given the ones before it were accepted
        "alpha_draft_at_position": draft_summary["acceptance_at_position"] if draft_summary else None,
        "tau": summary["tau"],
        "costs": costs,
        "predicted_speedup": predicted,
        "overhead_free_bound": bound,
        "in_run_costs": in_run,
        "break_even_alpha": break_even_alpha(gamma, even["c"], even["v"]),
        "break_even_costs": {"row": even_row, "c": even["c"], "v": even["v"]},
        "speculative_time_s": summary["time_s"],
        "per_category": summary.get("per_category", {}),
    }


def _paired(outputs: dict, seconds: dict, a: str, b: str, seed: int) -> dict:
    return paired_speedup([len(o) for o in outputs[a]], seconds[a], [len(o) for o in outputs[b]], seconds[b],
                          seed=seed)


def challenger_report(challenger, second: dict, decoder, decoders: dict, target, prompts, stats: dict, categories,
                      outputs: dict, seconds: dict, seed: int, chain_k: int = ENGINE_CHAIN) -> dict:
    """The challenger draft beside the draft: its step costs, its own α, and its decoder against the draft's."""
    run = draft_alpha_row(second)
    summary = aggregate_stats(stats[run], categories, seed=seed) if run else None
    drafter = costed_drafter(decoders[CHALLENGER_ROWS["speculative"]].drafter, output_size(target.model))
    return {
        "source": challenger.source,
        "costs": step_costs(decoder.target_runner, drafter, prompts[0], decoder.gamma.gamma),
        "alpha_draft": summary["acceptance_rate"] if summary else None,
        "alpha_draft_at_position": summary["acceptance_at_position"] if summary else None,
        "vs_draft": _paired(outputs, seconds, CHALLENGER_ROWS["speculative"], "speculative", seed),
        "chain": text_chains(target, challenger, prompts, outputs[TARGET_ONLY], chain_k, seed),
    }


def text_chains(target, draft, prompts: Sequence[list[int]], responses: Sequence[list[int]], k: int,
                seed: int) -> dict | None:
    """`decode.chain_acceptance.chain_summary` of `draft` in chains of k over the target's greedy responses (None
    without a draft model)."""
    if draft is None:
        return None
    chains = greedy_chains(target.model, draft.model, [p + r for p, r in zip(prompts, responses)],
                           [len(p) for p in prompts], k, draft_token_ids=draft.token_ids)
    return chain_summary(chains, seed=seed)


def paired_comparisons(outputs: dict, seconds: dict, decoders: dict, compare: dict | None, seed: int) -> dict:
    """Trees against the same decoder in chains, and each --compare decoder against the configured one and against
    chains, paired over the prompts."""
    return {
        "trees_vs_chain": _paired(outputs, seconds, "speculative", CHAIN, seed) if CHAIN in decoders else None,
        "compared": {name: {against: _paired(outputs, seconds, name, row, seed)
                            for against, row in (("vs_speculative", "speculative"), ("vs_chain", CHAIN))
                            if row in decoders}
                     for name in compare or {}},
    }
