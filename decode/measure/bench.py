"""`draftops bench`: target-only greedy vs HF assisted generation vs this decoder on the same prompts.

Methods: `target_only` (HF `generate` on the target alone, on the linear kernels draftops chose, `cpu_linear`),
`target_only_torch` (the same on torch's stock kernels: what a user gets without draftops; only where draftops chose
other kernels), `plain` (greedy decoding through this decoder's own target forward, no draft: what the runtime alone
gains), `hf_assisted` (the same draft and γ through transformers) and `speculative` (this decoder). Every speedup is
stated against the faster of the two target-only rows, the strongest baseline (`baseline` in the report), so that
draftops' kernels cannot make its own denominator slow. They run interleaved (their order rotates per prompt) so
that machine load hits all of them alike. The step costs c and v are measured separately, and again from
the run's own timings, to compare the measured speedup with Leviathan's prediction and the overhead-free bound.

When the decoder has more than one source (prompt lookup, suffix decoding, the draft model), each runs alone too
(`draft_only`, `lookup_only`, `suffix_only`); with tree rounds, the same decoder and the draft alone also run in
chain rounds (`chain`, `draft_only_chain`). `--compare` adds decoder rows with other decode settings
(`decoder_rows`).

Where llama.cpp is built (`decode.serving.llamacpp`), two more rows run interleaved with these: `llama_cpp_target_only`
and `llama_cpp_speculative` (llama-server on the target's GGUF, alone and with the draft exported as GGUF), what a CPU
user would run instead. llama.cpp computes with its own quantized kernels, so it decodes a slightly different model than
the float32 target the other rows share: its speculative row is compared with its own target-only row (speedup,
identical outputs, the acceptance its server reports), and it is not a candidate for the denominator above.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from decode.acceptance import break_even_alpha, expected_speedup
from decode.drafters.chain import DECODER, DRAFT, LOOKUP, SUFFIX, output_size
from decode.drafters.lookup import LookupThenModelDrafter, PromptLookupDrafter, lookup_max_ngram
from decode.drafters.tree import ModelTree, TreeDrafter
from decode.factory import build_decoder, tree_budget_choice
from decode.measure.intervals import aggregate_stats, paired_speedup, ratio_ci
from decode.models.feature_draft import FeatureDraft, FeatureDrafter
from decode.runtime.forward import ModelRunner, greedy_decode, rollback
from decode.runtime.kernels import cpu_linear_of, torch_kernels
from decode.runtime.timing import run_interleaved, timed
from decode.serving.export import GGUF, draft_source, export_format
from decode.serving.llamacpp import Completion, LlamaCppError, LlamaServer, optional_rows, served_target
from decode.serving.loading import hf_assistant_model
from decode.step_costs import representative_tree
from pipeline import metrics as M
from pipeline.config import DecodeConfig
from pipeline.sources import HF_ASSISTANT_DIR, eos_token_ids

TARGET_ONLY, TARGET_ONLY_TORCH = "target_only", "target_only_torch"  # the two baselines; the faster is the denominator
LLAMA_CPP_TARGET_ONLY, LLAMA_CPP_SPECULATIVE = "llama_cpp_target_only", "llama_cpp_speculative"


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


def costed_drafter(drafter, vocab_size: int):
    """The chain drafter whose step `step_costs` charges for `drafter`: the model half of a lookup-first hybrid, the
    model source of a token tree (its first), prompt lookup for a tree without one, else the drafter itself. For
    trees `step_costs` also times the tree's own verify (`tree_budget`)."""
    if isinstance(drafter, LookupThenModelDrafter):
        return drafter.model
    if isinstance(drafter, TreeDrafter):
        models = [source.drafter for source in drafter.sources if isinstance(source, ModelTree)]
        return models[0] if models else PromptLookupDrafter(vocab_size)
    return drafter


@torch.inference_mode()
def step_costs(target: ModelRunner, draft, prompt: list[int], gamma: int, reps: int = 20,
               tree_budget: int = 0) -> dict[str, float]:
    """Median seconds of one cached target step, one draft step and one (γ+1)-token verify; c and v as ratios. With
    `tree_budget` nodes also a tree verify of that many (`decode.step_costs.representative_tree`) and v_tree.

    Timed the way the decoder runs them: target is its `ModelRunner`, draft its `ModelDrafter` or a
    `PromptLookupDrafter`, whose step is one lookup of γ tokens divided by γ (one lookup per round).
    """

    def cost(forward, cache, device, n_tokens: int) -> float:
        forward(torch.tensor(prompt, device=device), cache, 0, True)
        tokens = torch.tensor(prompt[-1:] * n_tokens, device=device)
        times = []
        for _ in range(reps + 2):
            _, seconds = timed(lambda: forward(tokens, cache, len(prompt), n_tokens == 1), device)
            rollback(cache, len(prompt))
            times.append(seconds)
        return statistics.median(times[2:])

    def target_cost(n_tokens: int) -> float:
        return cost(target.forward, target.new_cache(), _device(target.model), n_tokens)

    if isinstance(draft, PromptLookupDrafter):
        lookups = [timed(lambda: draft.lookup(prompt, gamma), torch.device("cpu"))[1] for _ in range(reps + 2)]
        draft_step = statistics.median(lookups[2:]) / gamma
    elif isinstance(draft, FeatureDrafter):  # one step of the feature draft and its head, on stand-in features
        draft_step = cost(feature_step(draft.model), draft.model.new_cache(), draft.device, 1)
    else:  # the ModelDrafter the decoder runs: the draft's forward as the decoder calls it
        draft_step = cost(draft.runner.forward, draft.runner.new_cache(), draft.device, 1)

    def tree_cost(budget: int) -> float:
        device = _device(target.model)
        tree = representative_tree(budget, output_size(target.model))
        tokens, positions, mask = tree.pass_inputs(prompt[-1], len(prompt), device)
        cache = target.new_cache()
        target.forward(torch.tensor(prompt, device=device), cache, 0, True)
        times = [timed(lambda: target.forward_tree(tokens, cache, len(prompt), positions, mask), device)[1]
                 for _ in range(reps + 2)]
        return statistics.median(times[2:])

    target_step, verify = target_cost(1), target_cost(gamma + 1)
    costs = {"target_step_s": target_step, "draft_step_s": draft_step, "verify_s": verify,
             "c": draft_step / target_step, "v": verify / target_step}
    if tree_budget:
        tree_verify = tree_cost(tree_budget)
        costs.update(tree_budget=tree_budget, tree_verify_s=tree_verify, v_tree=tree_verify / target_step)
    return costs


def feature_step(draft: FeatureDraft) -> Callable:
    """A feature draft's step in `step_costs`' forward signature: what a decoding step computes (the layer over the
    token and a hidden state, then the head), with zeros for the hidden state (the cost does not depend on it)."""
    def forward(tokens: torch.Tensor, cache, start: int, keep_last: bool) -> torch.Tensor:
        hidden = torch.zeros(tokens.shape[0], draft.config.hidden_size, dtype=draft.fc.weight.dtype,
                             device=tokens.device)
        positions = torch.arange(start + 1, start + 1 + tokens.shape[0], device=tokens.device)
        out = draft.step(hidden, tokens, cache, start, positions)
        return draft.logits(out[-1:] if keep_last else out)
    return forward


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
    """The target-only row with the most tokens per second: the denominator of every speedup."""
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


def llama_cpp_rows(servers: dict[str, LlamaServer], max_new_tokens: int,
                   completions: dict[str, list[Completion]]) -> dict[str, Callable[[list[int]], list[int]]]:
    """Bench methods for started llama.cpp servers (row name -> server): greedy completions of the prompt's token
    ids, each kept in `completions[name]` for its acceptance."""
    def row(name: str, server: LlamaServer) -> Callable[[list[int]], list[int]]:
        def complete(prompt: list[int]) -> list[int]:
            completion = server.complete(prompt, max_new_tokens)
            completions[name].append(completion)
            return completion.tokens
        return complete

    for name in servers:
        completions[name] = []
    return {name: row(name, server) for name, server in servers.items()}


def gguf_draft(draft, vocabulary: Path, folder: Path) -> Path:
    """The layer `draft` (a loaded draft: its source and fingerprint) as a GGUF under `folder`, exported the first
    time and reused while the draft's fingerprint is the one recorded beside it."""
    out, recorded = folder / "draft", folder / "draft.fingerprint"
    if not (recorded.is_file() and recorded.read_text() == draft.fingerprint and any(out.glob("*.gguf"))):
        export_format(draft_source(str(draft.path)), GGUF, out, force=True, vocabulary=vocabulary)
        recorded.write_text(draft.fingerprint)
    return next(out.glob("*.gguf"))


def llama_cpp_servers(mode: str, target: str, draft, gamma: int, folder: Path,
                      stack: contextlib.ExitStack) -> tuple[dict[str, LlamaServer] | None, str | None]:
    """({row: started LlamaServer}, None) for the llama.cpp rows, or (None, why not), by `mode` as
    `decode.serving.llamacpp.optional_rows` takes it: they run where llama-server is built, the draft is a layer draft
    and the target has a GGUF. The servers stop when `stack` closes."""

    def start() -> dict[str, LlamaServer]:
        if draft is None or isinstance(draft.model, FeatureDraft):
            raise LlamaCppError("llama.cpp's draft-model speculation takes a layer draft, not "
                                f"{'prompt lookup' if draft is None else 'a feature draft'}")
        target_file = served_target(target)
        draft_file = gguf_draft(draft, target_file, folder)
        threads = torch.get_num_threads()
        alone = LlamaServer(target_file, threads=threads, log=folder / "target_only.log")
        spec = LlamaServer(target_file, draft=draft_file, draft_max=gamma, threads=threads,
                           log=folder / "speculative.log")
        return {LLAMA_CPP_TARGET_ONLY: stack.enter_context(alone), LLAMA_CPP_SPECULATIVE: stack.enter_context(spec)}

    return optional_rows(mode, start)


def llama_cpp_summary(outputs: dict, seconds: dict, completions: dict[str, list[Completion]], seed: int) -> dict:
    """llama.cpp's speculative row against its own target-only row: paired speedup, outputs equal to it, and the
    acceptance its server reported (drafted and accepted tokens summed over the timed prompts)."""
    spec, alone = outputs[LLAMA_CPP_SPECULATIVE], outputs[LLAMA_CPP_TARGET_ONLY]
    timed_runs = completions[LLAMA_CPP_SPECULATIVE][-len(spec):]  # the warm-up's completion came first
    drafted, accepted = sum(c.drafted for c in timed_runs), sum(c.accepted for c in timed_runs)
    return {
        "speedup_vs_llama_cpp_target_only": paired_speedup(
            [len(o) for o in spec], seconds[LLAMA_CPP_SPECULATIVE], [len(o) for o in alone],
            seconds[LLAMA_CPP_TARGET_ONLY], seed=seed),
        "same_output_as_llama_cpp_target_only": sum(a == b for a, b in zip(spec, alone)),
        "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else float("nan"),
    }


CHAIN, DRAFT_ONLY_CHAIN = "chain", "draft_only_chain"
PLAIN_EAGER = "plain_eager"
SOURCE_ROWS = {DRAFT: "draft_only", LOOKUP: "lookup_only", SUFFIX: "suffix_only"}  # a source's row: it alone
# --challenger: a second draft's rows, each the row of the draft it stands in for
CHALLENGER_ROWS = {"speculative": "challenger", SOURCE_ROWS[DRAFT]: "challenger_draft_only",
                   DRAFT_ONLY_CHAIN: "challenger_draft_only_chain"}


def reserved_rows() -> set[str]:
    """Row names bench gives its own rows: a --compare row takes another."""
    return {TARGET_ONLY, TARGET_ONLY_TORCH, "plain", PLAIN_EAGER, "speculative", "hf_assisted", "hf_prompt_lookup",
            CHAIN, DRAFT_ONLY_CHAIN, *SOURCE_ROWS.values(), *CHALLENGER_ROWS.values(), LLAMA_CPP_TARGET_ONLY,
            LLAMA_CPP_SPECULATIVE}


def decoder_rows(decode: DecodeConfig, has_draft: bool) -> dict[str, tuple[DecodeConfig, str]]:
    """The decoders bench runs, by row name, as (decode settings, drafter kind): `speculative` (the configured
    decoder); when it has more than one source, each source alone (`SOURCE_ROWS`); with trees, the same decoder in
    chain rounds (`chain`) and the draft model alone in chain rounds (`draft_only_chain`), so trees and chains are
    compared in one run."""
    sources = ([LOOKUP] if decode.lookup_min_ngram is not None or not has_draft else []) + \
        ([SUFFIX] if decode.suffix_decoding else []) + ([DRAFT] if has_draft else [])
    rows = {"speculative": (decode, DECODER if has_draft else LOOKUP)}
    if len(sources) > 1:
        alone = decode.model_copy(update={"suffix": False})
        rows.update({SOURCE_ROWS[source]: (decode if source == SUFFIX else alone, source) for source in sources})
    if decode.tree_rounds:
        rows[CHAIN] = (decode.chain_rounds(), DECODER if has_draft else LOOKUP)
        if has_draft and len(sources) > 1:
            rows[DRAFT_ONLY_CHAIN] = (decode.chain_rounds(), DRAFT)
    return rows


def challenger_rows(rows: dict[str, tuple[DecodeConfig, str]]) -> dict[str, tuple[DecodeConfig, str]]:
    """The rows of `decoder_rows` that a second draft runs too (`CHALLENGER_ROWS`): the decoder with it in place of
    the draft, and it alone as the draft runs alone; the same decode settings, so two drafts (say the champion and a
    feature draft) are compared in one interleaved run."""
    return {CHALLENGER_ROWS[name]: row for name, row in rows.items() if name in CHALLENGER_ROWS}


def draft_alpha_row(rows: dict[str, tuple[DecodeConfig, str]]) -> str | None:
    """The row of `decoder_rows` that measures the draft model's own acceptance α: the draft alone in chain rounds,
    as eval and the monitor measure it (a tree's α̂ counts its top-k too). None without a draft."""
    for name, (row_decode, kind) in rows.items():
        alone = kind == DRAFT or (kind == DECODER and row_decode.lookup_min_ngram is None)
        if alone and not row_decode.tree_rounds:
            return name
    return None


def describe_trees(decode: DecodeConfig, target, draft) -> str:
    """The tree rounds of `decode`'s decoder in words: its node budget schedule (and where an "auto" one came
    from), its fixed budget, or chain rounds."""
    choice = tree_budget_choice(decode, target, draft)
    if choice is not None:
        return f"tree budget by context {[list(entry) for entry in choice.schedule]} ({choice.source})"
    return f"tree budget {decode.tree_budget}" if decode.tree_budget else "chain rounds"


def decoder_summary(stats: Sequence, categories: Sequence[str], seed: int) -> dict:
    """A decoder row's acceptance, τ and accepted tokens by tree source."""
    summary = aggregate_stats(stats, categories, seed=seed)
    return {key: summary[key] for key in ("acceptance_rate", "tau", "accepted_by_source", "acceptance_at_position")}


def run_bench(target, draft, prompts: Sequence[list[int]], categories: Sequence[str], decode: DecodeConfig, *,
              gamma: int | None = None, seed: int = 0, progress: bool = True,
              llama_cpp: dict[str, LlamaServer] | None = None, compare: dict[str, DecodeConfig] | None = None,
              challenger=None) -> dict:
    """target is a `pipeline.sources.ResolvedModel`, draft one too, or None to bench prompt lookup alone. Greedy
    throughout; `decode` (cfg.decode) describes the decoder, `gamma` overrides its γ policy with a fixed γ; the rows
    of `decoder_rows` run beside it. `compare`: more decoders to run beside it by row name (their own decode
    settings, same drafter kind). `progress`: a bar over the prompts on stderr. `llama_cpp`: started llama.cpp
    servers for the rows LLAMA_CPP_TARGET_ONLY and LLAMA_CPP_SPECULATIVE (`decode.serving.llamacpp`), run interleaved
    with the others on the same token ids. With `decode.compiled`, every draftops row runs compiled passes (compiled in
    the untimed warm-up run) and a `plain_eager` row runs plain greedy decoding through the eager lean forward, so
    that what compiling gains and what speculation gains stay apart. `challenger`: a second draft (a
    `ResolvedModel`) run in the rows of `challenger_rows`, its step costs and its own acceptance reported beside the
    draft's (`report["challenger"]`).

    With a γ schedule or adaptive γ, this decoder follows it; HF assisted generation and the cost model use its γ.
    """
    decode = decode.model_copy(update={"temperature": 0.0})
    max_new_tokens = decode.max_new_tokens
    eos = eos_token_ids(target.model, target.tokenizer)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else (eos or [0])[0]
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
    decoder = decoders["speculative"]
    policy = decoder.gamma
    fixed_gamma = policy.gamma
    common = dict(max_new_tokens=max_new_tokens, eos_ids=eos, pad_id=pad)
    kernels = cpu_linear_of(target.model)
    methods: dict[str, Callable[[list[int]], object]] = {TARGET_ONLY: lambda p: hf_generate(target.model, p, **common)}
    if kernels != "torch":
        methods[TARGET_ONLY_TORCH] = lambda p: hf_generate_on_torch_kernels(target.model, p, **common)
    methods["plain"] = lambda p: greedy_decode(decoder.target_runner, p, max_new_tokens, eos)
    notes = [f"speculative: {describe_trees(decode, target, draft)}"]
    if decode.compiled:
        eager_runner = ModelRunner(target.model, compiled=False)
        methods[PLAIN_EAGER] = lambda p: greedy_decode(eager_runner, p, max_new_tokens, eos)
        notes.append(f"decode.compiled: plain and the speculative rows run the target's and the draft's passes "
                     f"compiled (torch.compile, compiled in the warm-up run, not timed); {PLAIN_EAGER}: plain through "
                     "the eager lean forward")
    for name, d in decoders.items():
        methods[name] = (lambda d: lambda p: d.generate(p, max_new_tokens=max_new_tokens))(d)
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
    if draft is not None and decode.draft_min_confidence is not None:
        notes.append(f"the draft model ends a block where its top probability is below {decode.draft_min_confidence}; "
                     f"the cost model assumes γ={fixed_gamma} drafts a round, the in-run costs count the real ones")
    if policy.kind != "fixed":
        notes.append(f"this decoder follows the {policy.kind} γ policy {policy.to_dict()}; "
                     f"HF assisted and the cost model use γ={fixed_gamma}")
    if draft is None:  # HF's prompt lookup up to the n-gram length this decoder's lookup matches first
        ngram = lookup_max_ngram(decode.lookup_min_ngram)
        methods["hf_prompt_lookup"] = lambda p: hf_generate(target.model, p, gamma=fixed_gamma, lookup_ngram=ngram,
                                                            **common)
    elif isinstance(draft.model, FeatureDraft):
        notes.append("no hf_assisted row: transformers' assisted generation cannot run a feature draft (it reads the "
                     "target's hidden states, which assisted generation does not hand to an assistant model)")
    else:
        assistant = hf_assistant_model(draft)
        if draft.token_ids is not None:
            notes.append(f"HF assisted generation uses the draft's full-vocabulary copy ({HF_ASSISTANT_DIR}/): "
                         "transformers cannot use a reduced-vocabulary head")
        methods["hf_assisted"] = lambda p: hf_generate(target.model, p, assistant=assistant, gamma=fixed_gamma,
                                                       **common)

    completions: dict[str, list[Completion]] = {}
    if llama_cpp:
        methods.update(llama_cpp_rows(llama_cpp, max_new_tokens, completions))
        notes.append("llama_cpp rows: llama.cpp's server on the target's GGUF as llama.cpp runs it (its own quantized "
                     "kernels, so its greedy text may differ from the float32 target's), alone and with the exported "
                     f"draft (GGUF, draft-simple, up to γ={fixed_gamma} tokens a round, no prompt lookup)")
    device = _device(target.model)
    for run in methods.values():  # warm-up
        run(prompts[0])
    runs = run_interleaved(methods, tqdm(prompts, desc="bench", unit="prompt", disable=not progress), device)
    stats = {name: [result.stats for result in runs.outputs[name]] for name in decoders}
    outputs = {**runs.outputs, **{name: [result.token_ids for result in runs.outputs[name]] for name in decoders}}
    results, baseline = method_results(outputs, runs.seconds, seed)

    tree_budget = decoder.drafter.budget_at(len(prompts[0])) if isinstance(decoder.drafter, TreeDrafter) else 0
    costs = step_costs(decoder.target_runner, costed_drafter(decoder.drafter, output_size(target.model)),
                       prompts[0], fixed_gamma, tree_budget=tree_budget)
    summary = aggregate_stats(stats["speculative"], categories, seed=seed)
    alpha, tau = summary["acceptance_rate"]["value"], summary["tau"]["value"]
    c, v = costs["c"], costs["v"]
    in_run = in_run_costs(stats["speculative"], results[baseline])
    if tree_budget:  # a tree round: its draft forwards as the run made them, one tree verify; Leviathan's is a chain's
        predicted, bound = None, tau / (in_run["drafts_per_round"] * c + costs["v_tree"])
    else:
        predicted, bound = expected_speedup(alpha, fixed_gamma, c, v), tau / (fixed_gamma * c + v)
    draft_run = draft_alpha_row(rows)
    draft_summary = aggregate_stats(stats[draft_run], categories, seed=seed) if draft_run else None
    if second:
        challenger_run = draft_alpha_row(second)
        challenger_summary = aggregate_stats(stats[challenger_run], categories, seed=seed) if challenger_run else None
        challenger_report = {
            "source": challenger.source,
            "costs": step_costs(decoder.target_runner, costed_drafter(decoders[CHALLENGER_ROWS["speculative"]].drafter,
                                                                      output_size(target.model)),
                                prompts[0], fixed_gamma),
            "alpha_draft": challenger_summary["acceptance_rate"] if challenger_summary else None,
            "alpha_draft_at_position": challenger_summary["acceptance_at_position"] if challenger_summary else None,
            # the challenger's decoder against the draft's, paired over the prompts
            "vs_draft": paired_speedup([len(o) for o in outputs[CHALLENGER_ROWS["speculative"]]],
                                       runs.seconds[CHALLENGER_ROWS["speculative"]],
                                       [len(o) for o in outputs["speculative"]], runs.seconds["speculative"],
                                       seed=seed),
        }
    return {
        "n_prompts": len(prompts),
        "settings": {**policy.to_dict(), "max_new_tokens": max_new_tokens, "greedy": True, "device": str(device),
                     "cpu_linear": kernels,
                     **({"lookup_min_ngram": decode.lookup_min_ngram} if draft is None or len(decoders) > 1 else {}),
                     **({"draft_min_confidence": decode.draft_min_confidence} if draft is not None else {})},
        "drafters": {name: d.drafter.name for name, d in decoders.items()},
        "methods": results,
        "baseline": baseline,
        "alpha": summary["acceptance_rate"],
        "alpha_draft": draft_summary["acceptance_rate"] if draft_summary else None,
        # the draft model alone: acceptance at each draft position given the ones before it were accepted
        "alpha_draft_at_position": draft_summary["acceptance_at_position"] if draft_summary else None,
        "tau": summary["tau"],
        "costs": costs,
        "predicted_speedup": predicted,
        "overhead_free_bound": bound,
        "in_run_costs": in_run,
        "break_even_alpha": break_even_alpha(fixed_gamma, in_run["c"], in_run["v"]),
        "speculative_time_s": summary["time_s"],
        "decoders": {name: decoder_summary(stats[name], categories, seed) for name in decoders},
        "per_category": summary.get("per_category", {}),
        "llama_cpp": llama_cpp_summary(outputs, runs.seconds, completions, seed) if llama_cpp else None,
        # trees against the same decoder in chains, paired over the prompts
        "trees_vs_chain": paired_speedup([len(o) for o in outputs["speculative"]], runs.seconds["speculative"],
                                         [len(o) for o in outputs[CHAIN]], runs.seconds[CHAIN], seed=seed)
        if CHAIN in decoders else None,
        "challenger": challenger_report if second else None,
        # each --compare decoder against the configured one and against chains, paired over the prompts
        "compared": {name: {against: paired_speedup([len(o) for o in outputs[name]], runs.seconds[name],
                                                    [len(o) for o in outputs[row]], runs.seconds[row], seed=seed)
                            for against, row in (("vs_speculative", "speculative"), ("vs_chain", CHAIN))
                            if row in decoders}
                     for name in compare or {}},
        "notes": notes,
    }


def markdown(report: dict) -> str:
    s, baseline = report["settings"], report["baseline"]
    lines = [
        "# draftops bench",
        "",
        f"{report['n_prompts']} prompts, greedy, γ={s['gamma']}, max_new_tokens={s['max_new_tokens']}, "
        f"device {s['device']}. Intervals: 95% bootstrap over prompts.",
        "",
        f"Speedups are against {baseline}, the faster target-only row (the denominator): target_only is HF "
        + (f"generate on draftops' linear kernels (cpu_linear {s['cpu_linear']})" if s["device"] == "cpu"
           else f"generate on {s['device']}")
        + (", target_only_torch on torch's stock kernels." if TARGET_ONLY_TORCH in report["methods"] else "."),
        "",
        f"| method | new tokens | seconds | tokens/s | speedup vs {baseline} | same output as target_only |",
        "|---|---:|---:|---|---|---:|",
    ]
    for name, r in report["methods"].items():
        tps = r["tokens_per_s"]
        speedup = r.get("speedup")
        speedup_text = (f"{speedup['value']:.2f}x [{speedup['low']:.2f}, {speedup['high']:.2f}]" if speedup
                        else "1 (denominator)")
        lines.append(f"| {name} | {r['new_tokens']} | {r['seconds']:.2f} | {tps['value']:.1f} "
                     f"[{tps['low']:.1f}, {tps['high']:.1f}] | {speedup_text} | "
                     f"{r['same_output_as_target']}/{report['n_prompts']} |")
    a, t, k, r = report["alpha"], report["tau"], report["costs"], report["in_run_costs"]
    speculative = report["methods"]["speculative"]
    time_s = report["speculative_time_s"]
    lines += [
        "",
        f"- speculative / plain (the same forward without a draft): "
        f"{speculative['tokens_per_s']['value'] / report['methods']['plain']['tokens_per_s']['value']:.2f}x",
        *([f"- speculative (trees) / chain (the same decoder in chain rounds, paired over prompts): "
           f"{report['trees_vs_chain']['value']:.2f}x [{report['trees_vs_chain']['low']:.2f}, "
           f"{report['trees_vs_chain']['high']:.2f}]"] if report.get("trees_vs_chain") else []),
        *[f"- {name} (--compare) / {against.removeprefix('vs_')}, paired over prompts: {r['value']:.2f}x "
          f"[{r['low']:.2f}, {r['high']:.2f}]"
          for name, ratios in report.get("compared", {}).items() for against, r in ratios.items()],
        f"- acceptance of this decoder ({report['drafters']['speculative']}) α̂ = {a['value']:.3f} "
        f"[{a['low']:.3f}, {a['high']:.3f}]; tokens per target call τ = {t['value']:.2f} "
        f"[{t['low']:.2f}, {t['high']:.2f}]",
        f"- step costs: target {k['target_step_s'] * 1e3:.2f} ms, draft {k['draft_step_s'] * 1e3:.2f} ms, "
        f"verify of γ+1 tokens {k['verify_s'] * 1e3:.2f} ms -> c = {k['c']:.3f}, v = {k['v']:.3f}",
        *([f"- tree verify of {k['tree_budget']} nodes (the first prompt's budget) {k['tree_verify_s'] * 1e3:.2f} ms "
           f"-> v_tree = {k['v_tree']:.3f}; overhead-free bound τ/(d·c+v_tree) = {report['overhead_free_bound']:.2f}x "
           f"with d = {r['drafts_per_round']:.2f} draft calls per round, the run's (costs isolated at the first "
           "prompt's context; Leviathan's prediction is a chain's, not given for trees)"] if "v_tree" in k else
          [f"- Leviathan's prediction (1−α^(γ+1))/((1−α)(γc+v)) = {report['predicted_speedup']:.2f}x; "
           f"overhead-free bound τ/(γc+v) = {report['overhead_free_bound']:.2f}x (costs isolated at the first "
           "prompt's context)"]),
        f"- in-run costs (each call at its real context): one target step {r['target_step_s'] * 1e3:.2f} ms, "
        f"c = {r['c']:.3f}, v = {r['v']:.3f}, {r['drafts_per_round']:.2f} drafts per round; overhead-free bound "
        f"{r['overhead_free_bound']:.2f}x, reached {speculative['speedup']['value'] / r['overhead_free_bound']:.2f} "
        f"of it (time in model calls {r['model_time_share']:.1%}); break-even acceptance at these costs "
        f"{report['break_even_alpha']:.2f} (below it this draft makes decoding slower)",
        f"- speculative time split: draft {time_s['draft_s']:.2f} s, verify {time_s['verify_s']:.2f} s, "
        f"prefill {time_s['prefill_s']:.2f} s, overhead {time_s['overhead_s']:.2f} s",
    ]
    if report["alpha_draft"] is not None:
        d = report["alpha_draft"]
        lines.append(f"- acceptance of the draft model alone α̂ = {d['value']:.3f} [{d['low']:.3f}, {d['high']:.3f}]")
        lines.append("- its acceptance by draft position (given the earlier ones accepted): " + ", ".join(
            f"{a:.2f}" for a in report.get("alpha_draft_at_position") or []))
    if report.get("challenger"):
        ch = report["challenger"]
        costs = ch["costs"]
        lines.append(f"- challenger draft {ch['source']}: draft step {costs['draft_step_s'] * 1e3:.2f} ms, "
                     f"c = {costs['c']:.3f}"
                     + (f"; alone α̂ = {ch['alpha_draft']['value']:.3f} [{ch['alpha_draft']['low']:.3f}, "
                        f"{ch['alpha_draft']['high']:.3f}], by draft position "
                        + ", ".join(f"{a:.2f}" for a in ch["alpha_draft_at_position"])
                        if ch["alpha_draft"] else "")
                     + f"; its decoder over the draft's (paired over prompts): {ch['vs_draft']['value']:.2f}x "
                       f"[{ch['vs_draft']['low']:.2f}, {ch['vs_draft']['high']:.2f}]")
    if report.get("llama_cpp"):
        ll = report["llama_cpp"]
        speedup = ll["speedup_vs_llama_cpp_target_only"]
        lines.append(f"- llama.cpp: speculative / its target alone {speedup['value']:.2f}x [{speedup['low']:.2f}, "
                     f"{speedup['high']:.2f}], acceptance {ll['acceptance']:.3f} ({ll['accepted']} of "
                     f"{ll['drafted']} drafted tokens), same output as its target alone "
                     f"{ll['same_output_as_llama_cpp_target_only']}/{report['n_prompts']}")
    if len(report["decoders"]) > 1:
        lines += ["", "| decoder | drafter | α̂ | τ | accepted tokens by tree source |", "|---|---|---|---|---|"]
        for name, d in report["decoders"].items():
            a, t = d["acceptance_rate"], d["tau"]
            sources = ", ".join(f"{source} {n}" for source, n in sorted(d["accepted_by_source"].items())) or "–"
            lines.append(f"| {name} | {report['drafters'][name]} | {a['value']:.3f} [{a['low']:.3f}, "
                         f"{a['high']:.3f}] | {t['value']:.2f} [{t['low']:.2f}, {t['high']:.2f}] | {sources} |")
    if report["per_category"]:
        lines += ["", "| category | prompts | α̂ | τ |", "|---|---:|---|---|"]
        for name, c in report["per_category"].items():
            lines.append(f"| {name} | {c['n_prompts']} | {c['acceptance_rate']['value']:.3f} "
                         f"[{c['acceptance_rate']['low']:.3f}, {c['acceptance_rate']['high']:.3f}] | "
                         f"{c['tau']['value']:.2f} |")
    lines += [f"- note: {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def flat_metrics(report: dict) -> dict[str, float]:
    """MLflow metrics under `pipeline.metrics` names: speedup vs the strongest target-only baseline, throughput (of
    both target-only rows), c and v, live α and τ."""

    methods, costs = report["methods"], report["costs"]
    speculative = methods["speculative"]
    out = {
        M.SPEEDUP: speculative["speedup"]["value"],
        M.SPEEDUP_LOW: speculative["speedup"]["low"],
        M.SPEEDUP_HIGH: speculative["speedup"]["high"],
        M.TOKENS_PER_S: speculative["tokens_per_s"]["value"],
        M.TARGET_TOKENS_PER_S: methods[TARGET_ONLY]["tokens_per_s"]["value"],
        M.COST_RATIO_C: costs["c"],
        M.VERIFY_RATIO_V: costs["v"],
        M.OVERHEAD_FREE_BOUND: report["overhead_free_bound"],
        M.IN_RUN_COST_RATIO_C: report["in_run_costs"]["c"],
        M.IN_RUN_VERIFY_RATIO_V: report["in_run_costs"]["v"],
        M.IN_RUN_BOUND: report["in_run_costs"]["overhead_free_bound"],
        M.BREAK_EVEN_ALPHA: report["break_even_alpha"],
        M.ACCEPTANCE_DECODER: report["alpha"]["value"],
        M.tau_at(report["settings"]["gamma"]): report["tau"]["value"],
    }
    if report["predicted_speedup"] is not None:  # chain rounds only
        out[M.SPEEDUP_PREDICTED] = report["predicted_speedup"]
    if "v_tree" in costs:
        out[M.VERIFY_RATIO_V_TREE] = costs["v_tree"]
    if report["alpha_draft"] is not None:
        out[M.ACCEPTANCE_DRAFT] = report["alpha_draft"]["value"]
    if TARGET_ONLY_TORCH in methods:
        out[M.TARGET_TORCH_KERNELS_TOKENS_PER_S] = methods[TARGET_ONLY_TORCH]["tokens_per_s"]["value"]
    if "hf_assisted" in methods:
        out[M.SPEEDUP_HF_ASSISTED] = methods["hf_assisted"]["speedup"]["value"]
    if report.get("trees_vs_chain"):
        out[M.TREES_VS_CHAIN] = report["trees_vs_chain"]["value"]
    for name in report["decoders"]:
        if name != "speculative":
            out[M.decoder_speedup(name)] = methods[name]["speedup"]["value"]
    if report.get("llama_cpp"):
        out[M.LLAMA_CPP_TOKENS_PER_S] = methods[LLAMA_CPP_TARGET_ONLY]["tokens_per_s"]["value"]
        out[M.LLAMA_CPP_SPECULATIVE_TOKENS_PER_S] = methods[LLAMA_CPP_SPECULATIVE]["tokens_per_s"]["value"]
        out[M.LLAMA_CPP_SPEEDUP] = report["llama_cpp"]["speedup_vs_llama_cpp_target_only"]["value"]
        out[M.ACCEPTANCE_LLAMA_CPP] = report["llama_cpp"]["acceptance"]
    for name, summary in report["per_category"].items():
        out[M.per_category(M.ACCEPTANCE_DECODER, name)] = summary["acceptance_rate"]["value"]
    return M.finite(out)
