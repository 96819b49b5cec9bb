"""Per-prompt acceptance of a draft against a target, on chosen held-out requests.

Analytic: the target's greedy response to each prompt (cached per target fingerprint by
distill.data.responses), then one teacher-forced pass of both models; prompt i contributes the sum of
alpha_t = sum_x min(p_t, q_t) over its response tokens (acc) and their number (n). Live: real
speculative decoding; prompt i contributes accepted and verified draft tokens.

The analytic measurement also keeps, per prompt, the accepted and drafted tokens a serving engine would count for that
response at decode.gamma (`monitor.fleet.offline_expectation.engine_rounds`): what the post-deploy check compares an
engine's counters with.

Both run on torch's own linear kernels (`decode.runtime.kernels.torch_kernels`), whatever `cpu_linear` says: oneDNN's
packed weights sit beside the originals, once for the batched generator's stacked projections and once for the
teacher-forced pass's own, which would hold the target's weights three times over (docs/reliability.md). A check
is bounded by memory, not by these few passes' speed.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone

from tqdm.auto import tqdm

from decode.acceptance import analytic_acceptance
from decode.drafters.protocol import DRAFT
from decode.factory import build_decoder
from decode.runtime.kernels import torch_kernels
from distill.data.responses import cached_responses
from monitor.fleet.offline_expectation import engine_rounds
from monitor.stats.acceptance_tests import PromptAcceptance
from pipeline.config import DraftopsConfig
from pipeline.traffic import encode_configured

# Padded tokens per teacher-forced pass of the analytic measurement: with the prompts cut to traffic.max_prompt_tokens,
# what bounds its logits (this many rows of the vocabulary per model) whatever the traffic holds.
ACCEPTANCE_BATCH_TOKENS = 1024


@dataclass
class Measurement:
    """Per-prompt acceptance plus the prompts' token frequencies (the traffic profile for drift)."""

    request_ids: list[str]
    acc: list[float]
    n: list[float]
    token_counts: dict[int, int] = field(default_factory=dict)
    engine_acc: list[float] = field(default_factory=list)  # per prompt, as an engine counts (empty: not measured)
    engine_n: list[float] = field(default_factory=list)

    @property
    def values(self) -> PromptAcceptance:
        return PromptAcceptance.of(self.acc, self.n)

    @property
    def engine_values(self) -> PromptAcceptance | None:
        """Per-prompt (accepted, drafted) as a serving engine counts them, when measured."""
        return PromptAcceptance.of(self.engine_acc, self.engine_n) if self.engine_n else None

    @property
    def acceptance(self) -> float:
        return self.values.acceptance

    def subset(self, request_ids: list[str]) -> Measurement:
        """The given requests' values, in that order (token counts are kept whole)."""
        index = {r: i for i, r in enumerate(self.request_ids)}
        rows = [index[r] for r in request_ids]
        engine = ([self.engine_acc[i] for i in rows], [self.engine_n[i] for i in rows]) if self.engine_n else ([], [])
        return Measurement(list(request_ids), [self.acc[i] for i in rows], [self.n[i] for i in rows],
                           self.token_counts, *engine)

    def to_dict(self) -> dict:
        engine = {"engine_acc": self.engine_acc, "engine_n": self.engine_n} if self.engine_n else {}
        return {"request_ids": self.request_ids, "acc": self.acc, "n": self.n,
                "token_counts": {str(k): v for k, v in self.token_counts.items()}, **engine}

    @classmethod
    def from_dict(cls, data: dict) -> Measurement:
        return cls(list(data["request_ids"]), [float(x) for x in data["acc"]], [float(x) for x in data["n"]],
                   {int(k): int(v) for k, v in data.get("token_counts", {}).items()},
                   [float(x) for x in data.get("engine_acc", [])], [float(x) for x in data.get("engine_n", [])])


@dataclass
class Baseline:
    """A version's reference acceptance: measured on held-out prompts with the target of `target_fingerprint`.
    Its dict is the JSON payload `pipeline.registry.save_baseline` stores with the version."""

    target_fingerprint: str
    measurement: Measurement
    created: str

    def to_dict(self) -> dict:
        return {"target_fingerprint": self.target_fingerprint, "created": self.created,
                "measurement": self.measurement.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> Baseline:
        return cls(data["target_fingerprint"], Measurement.from_dict(data["measurement"]), data["created"])


def new_baseline(target_fingerprint: str, measurement: Measurement) -> Baseline:
    return Baseline(target_fingerprint, measurement, datetime.now(timezone.utc).isoformat(timespec="seconds"))

def prompt_token_counts(prompts: list[list[int]]) -> dict[int, int]:
    return dict(Counter(t for p in prompts for t in p))


def measure_analytic(cfg: DraftopsConfig, target, draft, requests: list) -> Measurement:
    """Analytic per-prompt acceptance of `draft` (a ResolvedModel) against `target` on `requests`, on torch's
    kernels (the module's docstring says why)."""
    with torch_kernels(target.model), torch_kernels(draft.model):
        return _measure_analytic(cfg, target, draft, requests)


def _measure_analytic(cfg: DraftopsConfig, target, draft, requests: list) -> Measurement:

    prompts, _ = encode_configured(requests, target.tokenizer, cfg.traffic)
    responses, _, _ = cached_responses(
        target.model, target.tokenizer, target.fingerprint, requests, prompts, samples=1,
        max_new_tokens=cfg.decode.max_new_tokens, temperature=cfg.distill.generation_temperature,
        batch_size=cfg.distill.generation_batch_size, seed=cfg.seed, topk=1, progress=sys.stderr.isatty())
    sequences = [p + r for p, r in zip(prompts, responses.response_ids)]
    per_position: list[list[float]] = [[] for _ in sequences]
    for group in length_batches([len(s) for s in sequences], ACCEPTANCE_BATCH_TOKENS):
        result = analytic_acceptance(
            target.model, draft.model, [sequences[i] for i in group], [len(prompts[i]) for i in group],
            temperature=cfg.decode.temperature, top_k=cfg.decode.top_k, top_p=cfg.decode.top_p,
            draft_token_ids=draft.token_ids, batch_size=len(group))
        for i, alphas in zip(group, result.per_position):
            per_position[i] = alphas
    keep = [i for i, alphas in enumerate(per_position) if alphas]  # an empty response drafts nothing
    engine = [engine_rounds(per_position[i], cfg.decode.gamma, cfg.decode.max_new_tokens) for i in keep]
    return Measurement([requests[i].id for i in keep], [float(sum(per_position[i])) for i in keep],
                       [float(len(per_position[i])) for i in keep], prompt_token_counts(prompts),
                       [a for a, _ in engine], [n for _, n in engine])


def length_batches(lengths: list[int], budget: int, most: int = 8) -> list[list[int]]:
    """Indices in batches of similar length, each at most `most` sequences and `budget` padded tokens (a longer
    sequence alone): a teacher-forced pass holds logits for every padded position of its batch, so one long prompt
    among short ones would cost the batch's size times its length in vocabulary-wide rows."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if batches and len(batches[-1]) < most and (len(batches[-1]) + 1) * lengths[i] <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def measure_live(cfg: DraftopsConfig, target, draft, requests: list) -> Measurement:
    """The draft's own per-prompt acceptance (accepted / verified draft tokens) from real speculative decoding with
    the draft model alone (no prompt lookup) in chain rounds (a tree's top-k would measure something else): the
    `acceptance/draft` that eval reports too."""

    prompts, _ = encode_configured(requests, target.tokenizer, cfg.traffic)
    decoder = live_decoder(cfg, target, draft)
    ids, acc, n = [], [], []
    for request, prompt in tqdm(zip(requests, prompts), total=len(requests), desc="monitor: live acceptance",
                                unit="prompt", disable=None):
        stats = decoder.generate(prompt, seed=cfg.seed).stats
        if stats.verified:
            ids.append(request.id)
            acc.append(float(stats.accepted))
            n.append(float(stats.verified))
    return Measurement(ids, acc, n, prompt_token_counts(prompts))


def live_decoder(cfg: DraftopsConfig, target, draft):
    """The decoder the monitor measures the draft's own acceptance with: the draft alone in chain rounds, as eval's
    draft row (`decode.measure.evaluate.eval_decoders`), the config's sampling and length."""
    return build_decoder(target, draft, cfg.decode.chain_rounds(), kind=DRAFT)
