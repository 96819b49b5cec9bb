"""The loss step: one micro-batch through the draft, scored against the teacher at its response positions.

torchtune KD recipe shape: the loop (distill.loop) owns gradient accumulation, synchronization, the optimizer and
checkpoints; this is only "forward, then loss", so it can be tested on a batch written by hand.
"""
from __future__ import annotations

import torch

from decode.models.architectures import head_logits
from decode.models.feature_draft import FEATURES, FeatureDraft, window_start
from decode.runtime.forward import target_features
from distill.chains import ChainLayout, chain_loss, chain_window, check_attention, valid_logits
from distill.losses import TopKTeacher, acceptance_rate, distillation_loss, reach_weights, token_losses
from pipeline.config import DistillConfig


class ResponseLogits(torch.nn.Module):
    """The draft's logits at the masked (response) positions only, [N, V_draft]: the head and the loss skip prompt
    and padding positions. They are the logits the draft decodes with: its family's head step
    (`decode.models.architectures.head_logits`: Gemma 2's final soft-capping included) on its last hidden states. The
    module accelerate wraps (DDP), so gradient sync still sees every parameter."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, attention_mask, loss_mask, chains: ChainLayout | None = None):
        """chains: the on-policy stage's layout (`distill.chains`); then the logits at its valid nodes."""
        if chains is not None:
            return valid_logits(self.draft, chains)
        hidden = self.draft.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return head_logits(self.draft, hidden[loss_mask])


def response_teacher(batch: dict, target, device) -> torch.Tensor | TopKTeacher:
    """The teacher at the batch's response positions, [N, ...]: its cached top-k if the batch carries one, else the
    target's logits on the batch (the online teacher; on-policy batches have no cache)."""
    loss_mask = batch["loss_mask"]
    if "teacher" in batch:
        teacher = batch["teacher"][loss_mask]
        return TopKTeacher(teacher.logprobs.to(device), teacher.indices.to(device))
    with torch.no_grad():
        return target(input_ids=batch["input_ids"].to(device),
                      attention_mask=batch["attention_mask"].to(device)).logits[loss_mask.to(device)]


def loss_step(model, batch: dict, settings: DistillConfig, *, num_tokens: int | torch.Tensor,
              token_ids: torch.Tensor | None, device: torch.device | str, target=None) -> torch.Tensor:
    """This micro-batch's share of the step loss: `settings.loss` (+ `ce_weight` · cross-entropy) between the
    teacher and `model`'s logits at the response positions, in fp32, summed and divided by `num_tokens`.

    model: a `ResponseLogits` (or its accelerate wrapper). batch: a `distill.data.batches.collate` batch. num_tokens:
    the response tokens of the whole global batch (every process, every micro-batch), so that the summed
    gradients are those of the global per-token mean whatever the split. target: the online teacher, used when
    the batch carries no cached top-k.
    """
    teacher = response_teacher(batch, target, device)
    loss_mask = batch["loss_mask"].to(device)
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                   loss_mask=loss_mask)
    return distillation_loss(logits, teacher, loss=settings.loss, beta=settings.jsd_beta,
                             temperature=settings.temperature, token_ids=token_ids,
                             labels=batch["labels"].to(device)[loss_mask], ce_weight=settings.ce_weight,
                             num_tokens=num_tokens)


def chain_loss_step(model, batch: dict, settings: DistillConfig, *, target, num_tokens: int | torch.Tensor,
                    token_ids: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """`loss_step` for the on-policy stage: the draft's own chains in `batch["chains"]`, scored by `target` at each
    node (`distill.chains.chain_loss`); a feature draft's unroll is fed again the tokens it proposed
    (`batch["fed"]`)."""
    chains = batch["chains"]
    check_attention(target.config)  # one full-attention mask over the layout
    with torch.no_grad():
        target_logits = valid_logits(target, chains)
    if "fed" in batch:
        logits = model(features=batch["features"].to(device), input_ids=batch["input_ids"].to(device),
                       attention_mask=batch["attention_mask"].to(device), loss_mask=batch["loss_mask"].to(device),
                       chains=chains, fed=batch["fed"])
    else:
        logits = model(input_ids=None, attention_mask=None, loss_mask=None, chains=chains)
    return chain_loss(logits, target_logits, chains, settings, token_ids=token_ids, num_tokens=num_tokens)


class FeatureStepLogits(torch.nn.Module):
    """A feature draft's logits for each training-time-test step j at the positions whose token 2 + j ahead is a
    response token: [N_j, V_draft] per step, in `step_mask` order (`FeatureDraft.unroll`; step j at index i predicts
    token i + 2 + j, so its teacher is the target's distribution at position i + 1 + j). Prompt indices only feed the
    keys and values the response's indices attend to (`window_start`). The module accelerate wraps."""

    def __init__(self, draft: FeatureDraft, steps: int):
        super().__init__()
        self.draft, self.steps = draft, steps

    def forward(self, features, input_ids, attention_mask, loss_mask, steps: int | None = None,
                chains: ChainLayout | None = None, fed: torch.Tensor | None = None) -> list[torch.Tensor]:
        """steps: how many steps to unroll (default: the training's). chains, fed: the on-policy stage's layout and
        the tokens its steps were fed (`distill.chains.propose_features`); then the logits at its valid nodes."""
        if chains is not None:
            return self.chain_logits(features, input_ids, attention_mask, loss_mask, chains, fed)
        steps = steps or self.steps
        first = window_start(loss_mask, steps)
        outputs = self.draft.unroll(features, input_ids, attention_mask, steps, first=first)
        window = first[:, None] + torch.arange(outputs[0].shape[1], device=first.device)
        scored = torch.cat([loss_mask, loss_mask.new_zeros(loss_mask.shape[0], 1)], dim=1)  # last column: none
        return [self.draft.logits(hidden[scored.gather(1, (window + 1 + j).clamp(max=scored.shape[1] - 1))])
                for j, hidden in enumerate(outputs)]

    def chain_logits(self, features, input_ids, attention_mask, loss_mask, chains: ChainLayout,
                     fed: torch.Tensor) -> torch.Tensor:
        """[N, V_draft] at the layout's valid nodes, in `chains.valid` order: node (j, p) is step j at index p − 1."""
        k = chains.nodes.shape[1]
        first, offsets = chain_window(chains, loss_mask)
        outputs = self.draft.unroll(features, input_ids, attention_mask, k, first=first, fed=lambda j, _: fed[j - 1])
        hidden = torch.stack(outputs, 1)  # [B, k, R, H]
        offsets = offsets.clamp(max=hidden.shape[2] - 1)
        at_nodes = hidden.gather(2, offsets[:, None, :, None].expand(-1, k, -1, hidden.shape[-1]))
        return self.draft.logits(at_nodes[chains.valid])


def step_mask(loss_mask: torch.Tensor, j: int) -> torch.Tensor:
    """Indices i of step j whose prediction (token i + 2 + j) is a response token: loss_mask shifted by 1 + j."""
    return loss_mask[:, 1 + j :]


@torch.no_grad()
def final_teacher(batch: dict, target, token_ids: torch.Tensor | None, device) -> TopKTeacher:
    """teacher=final: the target's log-probabilities over the draft's vocabulary [B, T, V_draft] at the response
    positions (elsewhere -inf, never read), rebuilt from its cached final hidden states and log-normalizers; as a
    top-k teacher whose k columns are the whole draft vocabulary, so its mass on ids the draft cannot emit stays in
    the tail bucket, never acceptable (`distill.losses.bucket_log_probs`)."""
    scored = batch["loss_mask"].to(device)  # step j reads the teacher at these positions alone (`shifted`, `step_mask`)
    hidden = batch["final"].to(device)[scored].to(target.dtype)
    rows = None if token_ids is None else token_ids.to(device)
    scores = head_logits(target, hidden, rows).float() - batch["final_log_z"].to(device)[scored][:, None]
    logprobs = scores.new_full((*scored.shape, scores.shape[-1]), float("-inf"))
    logprobs[scored] = scores
    return TopKTeacher(logprobs, torch.arange(scores.shape[-1], device=device).expand(logprobs.shape))


@torch.no_grad()
def features_and_teacher(batch: dict, target, layers: tuple[int, ...], device,
                         token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
    """The target's features [B, T, len(layers) * H] on the batch (cached in it by `distill.data.features`, else from a
    target pass), and its teacher [B, T, ...] (the whole distribution rebuilt from cached final states with
    teacher=final, the cached top-k when the batch has it, else the target's logits from the same pass)."""
    input_ids, attention_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    if "final" in batch and "features" in batch:
        return batch["features"].to(device), final_teacher(batch, target, token_ids, device)
    if "teacher" in batch and "features" in batch:
        teacher = batch["teacher"]
        return batch["features"].to(device), TopKTeacher(teacher.logprobs.to(device), teacher.indices.to(device))
    if "teacher" in batch:
        hidden = target.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        teacher = batch["teacher"]
        teacher = TopKTeacher(teacher.logprobs.to(device), teacher.indices.to(device))
    else:
        hidden = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        teacher = hidden.logits
    return target_features(hidden.hidden_states, layers), teacher


def shifted(teacher, j: int):
    """The teacher rows of positions 1 + j onwards (what step j's indices are scored against)."""
    if isinstance(teacher, TopKTeacher):
        return TopKTeacher(teacher.logprobs[:, 1 + j :], teacher.indices[:, 1 + j :])
    return teacher[:, 1 + j :]


def feature_loss_step(model, batch: dict, settings: DistillConfig, *, target, layers: tuple[int, ...],
                      num_tokens: int | torch.Tensor, token_ids: torch.Tensor | None,
                      device: torch.device | str) -> torch.Tensor:
    """`loss_step` for a feature draft: the mean over its training-time-test steps of `settings.loss` against the
    teacher, each step's sum divided by `num_tokens` (the global batch's response tokens, as in `loss_step`); with
    `ttt_weighting: reach` each term weighted by the chance that its step is reached (`reach_weights`)."""
    features, teacher = features_and_teacher(batch, target, layers, device, token_ids)
    loss_mask = batch["loss_mask"].to(device)
    per_step = model(features=features, input_ids=batch["input_ids"].to(device),
                     attention_mask=batch["attention_mask"].to(device), loss_mask=loss_mask)
    labels = batch["labels"].to(device)
    masks = [step_mask(loss_mask, j) for j in range(len(per_step))]
    teachers = [shifted(teacher, j)[mask] for j, mask in enumerate(masks)]
    # each step's divergence and α from one log-softmax of its logits: α also sets the later steps' reach weights
    terms = [(None, None) if settings.loss == "ce" else
             token_losses(logits, t, loss=settings.loss, beta=settings.jsd_beta, temperature=settings.temperature,
                          token_ids=token_ids) for logits, t in zip(per_step, teachers)]
    weights: list = [None] * len(per_step)
    if settings.ttt_weighting == "reach":
        with torch.no_grad():
            alphas = [alpha.detach() if alpha is not None else
                      acceptance_rate(logits, t, temperature=settings.temperature, token_ids=token_ids)
                      for (_, alpha), logits, t in zip(terms, per_step, teachers)]
        weights = reach_weights(alphas, masks)
    total = 0
    for j, logits in enumerate(per_step):
        total = total + distillation_loss(
            logits, teachers[j], loss=settings.loss, beta=settings.jsd_beta,
            temperature=settings.temperature, token_ids=token_ids, labels=labels[:, 1 + j :][masks[j]],
            ce_weight=settings.ce_weight, num_tokens=num_tokens, weights=weights[j], per_token=terms[j][0])
    return total / len(per_step)


def draft_module(settings: DistillConfig, draft) -> torch.nn.Module:
    """What the loop trains and accelerate wraps: `ResponseLogits` for a draft LM, `FeatureStepLogits` (unrolling
    `ttt_steps`) for a feature draft."""
    return FeatureStepLogits(draft, settings.ttt_steps) if settings.family == FEATURES else ResponseLogits(draft)
