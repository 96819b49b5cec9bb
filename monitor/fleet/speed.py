"""Does the draft pay in the engine? llama-server alone and with the draft in several settings, on the same prompts.

Every setting is its own llama-server (same binary, target GGUF, threads and one slot), all started at once and asked
in turn prompt by prompt (interleaved, so that a change of load on a shared machine touches every setting alike),
greedy up to `max_new_tokens`, after one warm-up request each. Tokens per second is the server's own count of
generated tokens over its generation time (`timings.predicted_n / predicted_ms`, prompt processing excluded), summed
over the prompts; the speedup is that against the target alone. The settings tried: the deployed draft as exported
(f16) at the demo's γ, the same draft as Q8_0 (half the bytes to read per drafted token), fewer draft tokens, and a
minimum draft probability (llama-server's `--spec-draft-p-min`: a round stops drafting where the draft is unsure).

Where would the draft pay? llama-server's synthetic acceptance (`--spec-synth-len L`, for benchmarking: the draft runs
and costs what it costs, but a round accepts as if the mean accepted length, target token included, were L) gives
tokens/s against the acceptance the draft would need, with the draft's real cost:

    python -m monitor.fleet.speed --target TARGET.gguf --draft DRAFT.gguf [--draft-q8 DRAFT_Q8.gguf] [--synthetic]
"""
from __future__ import annotations

import argparse
import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoTokenizer

from decode.serving.llamacpp import Completion, LlamaServer
from pipeline.sources import DEFAULT_TARGET, locate
from pipeline.traffic import DEFAULT_TRAFFIC, encode_prompts, first_per_category, load_traffic


@dataclass(frozen=True)
class Setting:
    name: str
    draft: Path | None = None
    draft_max: int = 5
    p_min: float = 0.0
    synthetic_length: float | None = None  # llama-server --spec-synth-len (benchmarking: output not valid)


@dataclass
class SpeedRow:
    setting: Setting
    tokens: int = 0
    milliseconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    same_as_alone: int = 0

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.tokens / self.milliseconds if self.milliseconds else float("nan")

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    def to_dict(self) -> dict:
        setting = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self.setting).items()}
        return {"setting": setting, "tokens": self.tokens, "milliseconds": self.milliseconds,
                "tokens_per_second": self.tokens_per_second, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "same_as_alone": self.same_as_alone}


def _add(row: SpeedRow, completion: Completion, alone: Completion | None) -> None:
    row.tokens += int(completion.timings.get("predicted_n", len(completion.tokens)))
    row.milliseconds += float(completion.timings.get("predicted_ms", 0.0))
    row.drafted += completion.drafted
    row.accepted += completion.accepted
    row.same_as_alone += int(alone is not None and completion.tokens == alone.tokens)


def measure_speed(target: Path, settings: list[Setting], prompts: list[list[int]], max_new_tokens: int, *,
                  threads: int | None, log_dir: Path) -> list[SpeedRow]:
    """One row per setting (the first must be the target alone, `draft=None`), in the order given."""
    if not settings or settings[0].draft is not None:
        raise ValueError("the first setting is the target alone (draft None)")
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = [SpeedRow(s) for s in settings]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(LlamaServer(
            target, draft=s.draft, draft_max=s.draft_max, threads=threads, draft_p_min=s.p_min,
            log=log_dir / f"{s.name.replace(' ', '_').replace(',', '')}.log",
            extra_args=() if s.synthetic_length is None else ("--spec-synth-len", f"{s.synthetic_length:g}")))
            for s in settings]
        for server in servers:
            server.complete(prompts[0], 8)  # warm-up: weights paged in, buffers allocated
        for prompt in prompts:
            alone = None
            for row, server in zip(rows, servers):
                completion = server.complete(prompt, max_new_tokens)
                alone = alone or completion
                _add(row, completion, alone)
    return rows


def speed_table(rows: list[SpeedRow]) -> list[str]:
    """Markdown lines: tokens/s, speedup over the target alone, acceptance, outputs equal to the target alone's."""
    base = rows[0].tokens_per_second
    lines = ["| setting | tokens/s | vs target alone | acceptance (accepted/drafted) | same output as alone |",
             "|---|---|---|---|---|"]
    for row in rows:
        acceptance = "–" if not row.drafted else f"{row.acceptance:.3f} ({row.accepted}/{row.drafted})"
        if row.setting.synthetic_length is not None:
            acceptance += " forced"
        lines.append(f"| {row.setting.name} | {row.tokens_per_second:.1f} | {row.tokens_per_second / base:.2f}x | "
                     f"{acceptance} | {row.same_as_alone} |")
    return lines


def settings_for(draft: Path, draft_q8: Path | None, gamma: int, synthetic: bool) -> list[Setting]:
    """The target alone, the draft at γ, fewer tokens, a minimum probability, Q8_0; with `synthetic`, the Q8_0 (else
    f16) draft at γ with forced mean accepted lengths."""
    fast = draft_q8 or draft
    settings = [Setting("target alone"), Setting(f"draft f16, up to {gamma}", draft, gamma)]
    if draft_q8 is not None:
        settings.append(Setting(f"draft Q8_0, up to {gamma}", draft_q8, gamma))
    kind = "Q8_0" if draft_q8 else "f16"
    settings += [Setting(f"draft {kind}, up to 2", fast, 2), Setting(f"draft {kind}, up to 1", fast, 1),
                 Setting(f"draft {kind}, up to {gamma}, p-min 0.6", fast, gamma, 0.6),
                 Setting(f"draft {kind}, up to 3, p-min 0.8", fast, 3, 0.8)]
    if synthetic:
        settings += [Setting(f"draft {kind}, up to {gamma}, synthetic length {length:g}", fast, gamma,
                             synthetic_length=length) for length in (1.5, 2.5, 3.5, 4.5)]
    return settings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m monitor.fleet.speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="the target's GGUF")
    parser.add_argument("--draft", required=True, type=Path, help="the draft's GGUF (f16)")
    parser.add_argument("--draft-q8", type=Path, help="the same draft as Q8_0")
    parser.add_argument("--gamma", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=1, help="held-out prompts per category of the shipped traffic")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--synthetic", action="store_true", help="add rows of forced mean accepted lengths")
    parser.add_argument("--out", type=Path, default=Path("outputs/engine-speed"))
    args = parser.parse_args(argv)
    requests = first_per_category(load_traffic(DEFAULT_TRAFFIC).split("heldout"), args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(locate(DEFAULT_TARGET).path)
    prompts, _ = encode_prompts(requests, tokenizer, 384)
    rows = measure_speed(Path(args.target), settings_for(args.draft, args.draft_q8, args.gamma, args.synthetic),
                         prompts, args.max_new_tokens, threads=args.threads, log_dir=args.out)
    print("\n".join(speed_table(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speed.json").write_text(json.dumps([r.to_dict() for r in rows], indent=1))


if __name__ == "__main__":
    main()
