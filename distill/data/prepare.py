"""A distill job's data: the target's responses to the train split with the teacher's top-k, and its greedy
responses to the held-out split (what α and τ are measured on), cached; the draft vocabulary from them.

Which turns of a conversation are answered is `traffic.turns` (`distill.data.turns`); who answers them is
`distill.responses`: the built-in generator or inference servers (`engine`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from accelerate import PartialState

from decode.models.feature_draft import FEATURES
from decode.models.layer_draft import frequent_token_ids
from distill.data.features import cached_features, cached_final
from distill.data.generation.generate import engine_cached_responses
from distill.data.recorded import check_served_by, recorded_responses
from distill.data.responses import ResponseSet, cached_responses, check_teacher, generation_model
from distill.data.turns import TurnResponses, turn_responses
from distill.init import feature_layers
from distill.timings import Timings
from pipeline.config import DraftopsConfig
from pipeline.prompts import prompt_style
from pipeline.sources import eos_token_ids
from pipeline.traffic import encode_configured, load_traffic, reading_options


@dataclass
class TrainingData:
    """The loop's input: cached target responses to train on and to evaluate on, the draft vocabulary (None: the
    target's), the fingerprint of the training data (part of the job key) and what generated the training
    responses and their teacher (`builtin float32`, `engine llamacpp model.gguf (Q8_0, ...)`: a lineage tag)."""

    train: ResponseSet
    heldout: ResponseSet
    token_ids: torch.Tensor | None
    fingerprint: str
    teacher: str = "builtin"
    train_turns: int = 0  # the assistant turns trained on (`traffic.turns`); 0: one per train request
    by_turn: bool = False  # the held-out responses are conversations' turns (`traffic.turns: all`)


def prepare_data(cfg: DraftopsConfig, state: PartialState, target, timings: Timings) -> TrainingData:
    """Target responses on the train split (+ held-out ones for evaluation), cached; the draft vocabulary from them."""
    d = cfg.distill
    traffic = load_traffic(cfg.traffic.path, **reading_options(cfg.traffic))
    train_requests = traffic.split("train", cfg.traffic.heldout_fraction)
    if d.train_prompts:
        train_requests = train_requests[:d.train_prompts]
    heldout_requests = traffic.split("heldout", cfg.traffic.heldout_fraction)[:d.eval_prompts]
    if not train_requests or not heldout_requests:
        raise ValueError(f"{traffic.path}: need both train and held-out requests "
                         f"(got {len(train_requests)} and {len(heldout_requests)})")
    common = dict(max_new_tokens=d.max_new_tokens, temperature=d.generation_temperature,
                  batch_size=d.generation_batch_size, seed=cfg.seed, topk=d.topk,
                  progress=state.is_local_main_process)
    turns = cfg.traffic.turns

    def encode(requests: list) -> list[list[int]]:
        return encode_configured(requests, target.tokenizer, cfg.traffic)[0]

    def reply_text(ids: list[int]) -> str:
        return target.tokenizer.decode(ids, skip_special_tokens=True).strip()

    with timings.measure("generation_with_teacher_topk"), state.main_process_first():
        layers = feature_layers(d, target.model.config.num_hidden_layers) if d.family == FEATURES else ()
        if d.responses.source == "recorded":
            made, teacher = recorded_train_responses(cfg, target, train_requests, encode, reply_text)
        elif d.responses.engine == "openai":
            tags = []

            def respond(requests, prompts):
                responses, path, hit, tag = engine_train_responses(cfg, target, requests, prompts, **common)
                tags.append(tag)
                return responses, path, hit

            made = turn_responses(train_requests, turns, encode, respond, reply_text)
            teacher = tags[0]
        else:
            generator = generation_model(target.model, d.generation_dtype, batch_size=d.generation_batch_size)
            made = turn_responses(train_requests, turns, encode, lambda requests, prompts: cached_responses(
                generator, target.tokenizer, target.fingerprint, requests, prompts,
                samples=d.responses_per_prompt, capture=layers, **common), reply_text)
            teacher = "builtin " + str(next(generator.parameters()).dtype).removeprefix("torch.")
            del generator
        heldout = turn_responses(heldout_requests, turns, encode, lambda requests, prompts: cached_responses(
            target.model, target.tokenizer, target.fingerprint, requests, prompts, samples=1, **common),
            reply_text).responses
    train, train_dir = made.responses, made.paths[0]
    check_teacher(train, train_dir)  # before anything trains on it
    state.print(f"draftops distill: {len(train)} target responses ({train.num_response_tokens} tokens, "
                f"{teacher}) {'from the cache' if made.hit else 'generated'} at {train_dir}{turns_note(made)}")
    if d.family == FEATURES:  # the feature draft's inputs, once for the data set (`distill.data.features`)
        recorded = train.features is not None  # as the target generated them just now
        with timings.measure("target_features"), state.main_process_first():
            train.features, train.feature_offsets, hit = cached_features(
                target.model, train, train_dir, layers, progress=state.is_local_main_process)
        size = train.features.numel() * train.features.element_size() / 2**20
        how = "from the cache" if hit else "recorded as the target generated" if recorded else "computed"
        state.print(f"draftops distill: target features of layers {list(layers)} ({size:.0f} MiB fp16) {how}")
        if d.teacher == "final":  # the whole-distribution teacher, rebuilt per batch (`distill.step.final_teacher`)
            with timings.measure("target_final_states"), state.main_process_first():
                train.final_hidden, train.final_log_z, hit = cached_final(
                    target.model, train, train_dir, progress=state.is_local_main_process)
            state.print(f"draftops distill: target final states for the teacher "
                        f"{'from the cache' if hit else 'computed'}")
    token_ids = None
    if d.draft_vocab_size:
        token_ids = frequent_token_ids(train.response_ids, d.draft_vocab_size, target.tokenizer.all_special_ids)
    entries = "+".join(path.name for path in made.paths)
    fingerprint = hashlib.sha256(
        f"{traffic.fingerprint('train', cfg.traffic.heldout_fraction)}|{entries}|{d.responses_per_prompt}"
            .encode()).hexdigest()[:16]
    return TrainingData(train, heldout, token_ids, fingerprint, teacher, train_turns=made.turns,
                        by_turn=turns == "all")


def recorded_train_responses(cfg: DraftopsConfig, target, requests: list, encode, reply_text) -> tuple:
    """The logged replies to the train split's turns with the target's top-k (`distill.data.recorded`), where the log
    was served by the target: (TurnResponses, lineage tag)."""
    check_served_by(cfg.traffic.served_by, cfg.target, target.fingerprint)
    style, stop = prompt_style(cfg.traffic), eos_token_ids(target.model, target.tokenizer)
    d = cfg.distill
    made = turn_responses(requests, cfg.traffic.turns, encode, lambda turns, prompts: recorded_responses(
        target.model, target.tokenizer, target.fingerprint, turns, prompts, style=style, stop_ids=stop,
        max_new_tokens=d.max_new_tokens, topk=d.topk, batch_size=d.generation_batch_size), reply_text, recorded=True)
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    return made, f"recorded replies of {cfg.traffic.served_by}, builtin {dtype} teacher-forced top-k"


def turns_note(made: TurnResponses) -> str:
    """"" for one turn per request; else the turns answered and their positions."""
    if len(made.paths) == 1 and max(made.positions, default=1) == 1:
        return ""
    return (f"; {made.turns} assistant turns, positions 1..{max(made.positions)}, "
            f"{len(made.paths)} cache entries (one per position)")


def engine_train_responses(cfg: DraftopsConfig, target, requests: list, prompts: list[list[int]], *,
                           max_new_tokens: int, temperature: float, seed: int, topk: int, progress: bool,
                           batch_size: int) -> tuple:
    """The training responses generated by the servers of `distill.responses` (`distill.data.generation`):
    (responses, cache dir, whether all came from the cache, the engine's lineage tag)."""
    made = engine_cached_responses(
        cfg.distill.responses, target.fingerprint, requests, prompts, samples=cfg.distill.responses_per_prompt,
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, topk=topk,
        stop_ids=eos_token_ids(target.model, target.tokenizer), vocab_size=target.model.config.vocab_size,
        progress=progress)
    if made.stats is not None and progress:
        done = sum(made.stats.completed.values())
        print(f"draftops distill: {done} responses from {len(made.stats.completed)} server(s) in "
              f"{made.stats.seconds:.0f} s ({done / max(made.stats.seconds, 1e-9):.2f} responses/s, "
              f"{made.stats.retries} retries)")
    return made.responses, made.path, made.hit, f"engine {made.identity.tag()}"
