"""`distill.responses:`: which engine generates the training responses and their top-k teacher.

`builtin` is draftops' own continuous-batching generator on the target as loaded (no server needed). `openai` sends
the same prompts, rendered with the target's chat template, as token ids to one or more running inference servers
(vLLM, SGLang, llama.cpp's llama-server) and reads the response tokens and their top-k log-probabilities back
(docs/engines.md).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section, http_url


class ResponsesConfig(Section):
    """`distill.responses`. The held-out responses that α and τ are measured on always come from the target as
    loaded, whatever generates the training ones."""

    source: Literal["generate", "recorded"] = Field("generate", description=(
        "generate: the target answers the train split's prompts; recorded: the replies the log holds are trained on, "
        "with the target's top-k from one teacher-forced pass (no generation), only where traffic.served_by names "
        "the target. docs/data.md."))
    engine: Literal["builtin", "openai"] = Field("builtin", description=(
        "builtin: the target generates in this process (continuous batching, distill.generation_dtype); openai: "
        "OpenAI-compatible servers (servers) generate and return their top-k log-probs."))
    servers: list[str] = Field([], description=(
        "Base URLs of the servers, e.g. [http://10.0.0.1:8000, http://10.0.0.2:8000]; requests are spread over all "
        "of them. `draftops engine serve` starts llama-servers on this machine and prints theirs."))
    api: Literal["auto", "vllm", "sglang", "llamacpp"] = Field("auto", description=(
        "The servers' request format: vllm (/v1/completions), sglang (/generate), llamacpp (/completion); auto asks "
        "each server which it is."))
    model: str | None = Field(None, description="Served model name; null: the first one the server lists.")
    concurrency: int = Field(4, ge=1, description="Requests in flight per server (match its batch slots).")
    timeout: float = Field(600.0, gt=0.0, description=(
        "Seconds one request may take, all of it (connecting, the headers, the whole body), before it is retried."))
    retries: int = Field(3, ge=0, description=(
        "Retries of a failed request (connection, 429/5xx, timeout, a body cut short or not JSON), with backoff."))
    give_up_after: float = Field(900.0, gt=0.0, description=(
        "Seconds the job goes on retrying while no response comes back whole; past it, it stops with one line "
        "(the finished responses are kept: a rerun asks only for the rest)."))
    topk: int | None = Field(None, ge=1, description=(
        "Top-k log-probs asked of the server per token; null: distill.topk. vLLM caps it at its --max-logprobs "
        "(default 20); a server that returns fewer leaves the rest of the mass to the loss's tail bucket."))

    @field_validator("servers")
    @classmethod
    def _urls(cls, servers: list[str]) -> list[str]:
        for url in servers:
            http_url(url)
        return [url.rstrip("/") for url in servers]

    @model_validator(mode="after")
    def _recorded_on_the_builtin_teacher(self) -> ResponsesConfig:
        if self.source == "recorded" and self.engine != "builtin":
            raise ValueError("distill.responses.source=recorded takes its top-k from the target as loaded: it needs "
                             "distill.responses.engine=builtin")
        return self

    @model_validator(mode="after")
    def _servers_for_openai(self) -> ResponsesConfig:
        if self.engine == "openai" and not self.servers:
            raise ValueError("distill.responses.engine=openai needs distill.responses.servers (their base URLs)")
        return self
