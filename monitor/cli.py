"""`draftops monitor check | serve | simulate | rollback | deploy | demo` and `draftops target finetune` (a rehearsed
target update).

Command handlers import the modules their command runs when they run: the one documented exception to imports at the
top, so that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/code_shape/)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from monitor.fleet.commands import add_commands as add_engine_commands
from pipeline import metrics as M
from pipeline.command_options import config_options
from pipeline.locks import ModelBusy
from pipeline.registry import RegistryError


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def check_command(args) -> int:
    from monitor.check.decision import EXIT_ERROR, Status
    from monitor.check.run import run_check
    from monitor.service.alert_book import CHECK_CONDITIONS, lifecycle
    from monitor.service.alerts import failed_check_alert, report_alerts, send_within_deadline
    from monitor.service.scheduler import EXIT_BUSY, check_lock, log_failed_check
    from pipeline.config import load_config
    from pipeline.tracking import TrackingUnavailable, check_tracking, store_error_line

    _setup_logging()
    cfg = load_config(args.config, args.overrides)
    try:
        check_tracking(cfg)
        with check_lock(cfg):
            report = run_check(cfg)
    except ModelBusy as exc:
        print(f"draftops: {exc}; not checking", file=sys.stderr)
        return EXIT_BUSY
    except (RegistryError, TrackingUnavailable) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:  # one line here; the traceback goes to a file and to the check's FAILED run
        if store_error_line(exc) is not None:  # the store failed: nowhere to record the failed check either
            print(f"draftops: error: {store_error_line(exc)}", file=sys.stderr)
            return EXIT_ERROR
        where = _save_traceback(cfg, exc)
        log_failed_check(cfg, exc)
        first = (str(exc).strip().splitlines() or [""])[0][:500]
        print(f"draftops: error: monitor check failed: {type(exc).__name__}: {first} (traceback: {where})",
              file=sys.stderr)
        send_within_deadline(cfg, lifecycle(cfg, [failed_check_alert(cfg.tracking.registered_model,
                                                                     f"{type(exc).__name__}: {first}")]))
        return EXIT_ERROR
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    # the lock is released and the verdict printed: every active alert again, a resolve for each one cleared
    clears = CHECK_CONDITIONS if report.decision.status is not Status.ERROR else frozenset()
    send_within_deadline(cfg, lifecycle(cfg, report_alerts(report), clears))
    return report.exit_code


def _save_traceback(cfg, exc: BaseException) -> str:
    """Write the failed check's traceback to `<monitor.state_dir>/check-error.txt`; where it went."""
    import traceback

    path = Path(cfg.monitor.state_dir) / "check-error.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)))
    except OSError:
        logging.getLogger("draftops.monitor").exception("monitor check failed")
        return "stderr"
    return str(path)


def serve_command(args) -> int:
    from monitor.service.scheduler import serve
    from pipeline.config import load_config
    from pipeline.tracking import check_tracking

    _setup_logging()
    check_tracking(load_config(args.config, args.overrides))  # a service that cannot track its checks does not start
    return serve(args.config, run_now=args.run_now, overrides=args.overrides)


def simulate_command(args) -> int:
    from monitor.service.scheduler import state_dir
    from monitor.stats.false_alarms import power_figure, read_pairs, simulate_checks
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    m = cfg.monitor
    try:
        pairs = read_pairs(args.pairs) if args.pairs else None
    except ValueError as exc:
        print(f"draftops: error: --pairs {args.pairs}: {exc}", file=sys.stderr)
        return 2
    if args.server:
        return _simulate_server(cfg, pairs, args)
    result = simulate_checks(args.n or m.heldout_requests, m.level, m.margin, drops=m.simulate_drops,
                             n_checks=args.checks or m.simulate_checks, pairs=pairs, method=m.test_method,
                             n_bootstrap=min(m.n_bootstrap, 1000), seed=cfg.seed)
    out = Path(args.out) if args.out else state_dir(cfg) / "simulation"
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulation.json").write_text(json.dumps(result.to_dict(), indent=2))
    power_figure(result).savefig(out / "power.png", dpi=120)
    print(json.dumps(result.to_dict(), indent=2) if args.json else f"{result.summary()}\nwritten to {out}")
    return 0


def _simulate_server(cfg, windows, args) -> int:
    """`simulate --server`: the window test of the serving engines' counters, on the given windows, else on those the
    window store keeps (at least 2), else on synthetic ones of --requests-per-window requests; with --replicas R at
    monitor.level / (R + 1), as the check runs it for each of R replicas."""
    from monitor.fleet.window_store import recorded_windows
    from monitor.service.scheduler import state_dir
    from monitor.stats.window_simulation import simulate_window_checks

    m = cfg.monitor
    if windows is None and args.requests_per_window is None:
        windows = recorded_windows(cfg)
        windows = windows if len(windows) >= 2 else None
    level = m.level / (args.replicas + 1) if args.replicas > 1 else m.level
    result = simulate_window_checks(m.server_baseline_windows, m.server_recent_windows, level, m.margin,
                                    drops=m.simulate_drops, n_checks=args.checks or m.simulate_checks,
                                    windows=windows, seed=cfg.seed, requests_per_window=args.requests_per_window or 100,
                                    window_sd=args.window_sd, daily_amplitude=args.daily_amplitude,
                                    window_hours=args.window_hours)
    out = Path(args.out) if args.out else state_dir(cfg) / "simulation"
    out.mkdir(parents=True, exist_ok=True)
    (out / "server_simulation.json").write_text(json.dumps(result.to_dict(), indent=2))
    print(json.dumps(result.to_dict(), indent=2) if args.json else f"{result.summary()}\nwritten to {out}")
    return 0


def rebaseline_command(args) -> int:
    from monitor.check.rebaseline import rebaseline
    from monitor.service.scheduler import EXIT_BUSY, check_lock
    from pipeline.config import load_config
    from pipeline.tracking import check_tracking

    cfg = load_config(args.config, args.overrides)
    if not args.reason.strip() or not args.by.strip():
        print("draftops: error: rebaseline needs --by NAME and --reason TEXT (both recorded in MLflow)",
              file=sys.stderr)
        return 2
    check_tracking(cfg)
    try:
        with check_lock(cfg):  # never under a running check
            print(rebaseline(cfg, args.by.strip(), args.reason.strip()))
    except ModelBusy as exc:
        print(f"draftops: {exc}; not rebaselining (try again when it is free)", file=sys.stderr)
        return EXIT_BUSY
    except RegistryError as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2
    return 0


def rollback_command(args) -> int:
    from monitor.check.run import rollback
    from monitor.release.layout import DeployError
    from monitor.release.rollout import deploy_champion
    from monitor.service.alerts import rollback_alert, send_within_deadline
    from monitor.service.scheduler import EXIT_BUSY
    from pipeline.config import load_config
    from pipeline.tracking import check_tracking

    cfg = load_config(args.config, args.overrides)
    check_tracking(cfg)  # an operator's command during an outage fails at once, naming the server
    try:
        version = rollback(cfg, to_version=args.to_version)
    except ModelBusy as exc:
        print(f"draftops: {exc}; not rolling back (try again when it is free)", file=sys.stderr)
        return EXIT_BUSY
    print(f"{cfg.tracking.registered_model}@{M.CHAMPION} -> version {version}")
    send_within_deadline(cfg, [rollback_alert(cfg.tracking.registered_model, version)])
    if cfg.monitor.deploy.enabled:  # the rolled-back champion deployed too (its kept folder when there is one)
        try:
            result = deploy_champion(cfg)
        except DeployError as exc:
            print(f"draftops: error: {exc}", file=sys.stderr)
            return 2
        print(result.summary())
        return 0 if result.reloaded or result.action == "none" else 2
    return 0


def deploy_command(args) -> int:
    from monitor.release.layout import DeployError
    from monitor.release.rollout import Rollout, deploy_champion
    from monitor.service.scheduler import EXIT_BUSY, check_lock
    from pipeline.config import load_config

    _setup_logging()
    cfg = load_config(args.config, args.overrides)
    try:
        with check_lock(cfg):
            result = (Rollout(cfg).roll_back("rolled back by hand") if args.rollback
                      else deploy_champion(cfg, force=args.force))
    except ModelBusy as exc:
        print(f"draftops: {exc}; not deploying (try again when it is free)", file=sys.stderr)
        return EXIT_BUSY
    except (DeployError, RegistryError) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    return 0 if result.reloaded or result.action == "none" else 2


def demo_command(args) -> int:
    from decode.serving.llamacpp import LlamaCppError
    from monitor.rehearsal.drift_demo import run_demo
    from monitor.rehearsal.serve_demo import run_serve_demo
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    try:
        if args.serve:
            _setup_logging()
            return 0 if run_serve_demo(cfg, args.out, rehearse_mismatch=args.rehearse_mismatch,
                                       speed=not args.no_speed, per_window=args.window_requests).ok else 1
        return 0 if run_demo(cfg, args.out).ok else 1
    except (ValueError, LlamaCppError) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2


def target_finetune_command(args) -> int:
    from monitor.rehearsal.target_update import run_finetune
    from pipeline.config import load_config
    from pipeline.tracking import check_tracking, tracking_uri

    cfg = load_config(args.config, args.overrides)
    check_tracking(cfg)  # it logs its run: the store answers before the fine-tuning, not after it
    result = run_finetune(cfg)
    print(f"draftops target finetune: done ({cfg.target_update.style} style, {result.examples} examples, "
          f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f})")
    print("  time: " + "  ".join(f"{k} {v:.0f}s" for k, v in result.timings.items())
          + f"  (total {sum(result.timings.values()):.0f}s)")
    print(f"  target {cfg.target} ({result.base_fingerprint}) -> {result.path} ({result.fingerprint})")
    print(f"  MLflow: {tracking_uri(cfg)}  run {result.run_id}  (experiment draftops-target)")
    print(f"  check the champion against it: draftops monitor check{f' --config {args.config}' if args.config else ''}"
          f" target={result.path}")
    return 0


def report_command(args) -> int:
    from monitor.registry_report import build_report
    from pipeline.config import load_config
    from pipeline.tracking import check_tracking, setup_mlflow

    cfg = load_config(args.config, args.overrides)
    check_tracking(cfg)
    # MLflow set to the store the report reads, so that a failure of it names that one, not MLFLOW_TRACKING_URI's
    text = build_report(args.model or cfg.tracking.registered_model, fmt=args.format, tracking_uri=setup_mlflow(cfg),
                        checks=args.checks)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"written to {args.out}", file=sys.stderr)
    else:
        print(text, end="")
    return 0


def add_commands(subparsers) -> None:
    """The monitor package's subcommands (the `draftops.commands` entry point `monitor`)."""
    monitor = subparsers.add_parser("monitor", help="check the champion draft for drift, on demand or nightly")
    actions = monitor.add_subparsers(dest="action", required=True)
    for add in (_add_check, _add_serve, _add_simulate, _add_demo, _add_rollback, _add_rebaseline, _add_deploy):
        add(actions)
    _add_target_finetune(subparsers)
    _add_report(subparsers)
    add_engine_commands(subparsers)


def _add_check(actions) -> None:
    check = actions.add_parser(
        "check", help="measure the champion now; exit 0 OK, 3 DRIFT, 4 DEPLOY_MISMATCH (the engine does not show the "
                      "deployed draft's acceptance), 5 DEPLOY_FAILED (a deploy it ran failed), 6 REPLICA_DOWN (a "
                      "replica unreachable at monitor.replica_down_checks checks in a row), 2 error, 75 another "
                      "check running")
    check.add_argument("--json", action="store_true")
    config_options(check)
    check.set_defaults(handler=check_command)


def _add_serve(actions) -> None:
    serve = config_options(actions.add_parser("serve", help="run the check on the configured cron schedule"))
    serve.add_argument("--run-now", action="store_true", help="also run one check right away")
    serve.set_defaults(handler=serve_command)


def _add_simulate(actions) -> None:
    simulate = actions.add_parser(
        "simulate", help="false-alarm rate and power of the check at the configured N and level")
    simulate.add_argument("--pairs", help="JSON per-prompt (accepted, drafted) pairs to resample (default: a "
                                          "beta-binomial model with per-prompt heterogeneity)")
    simulate.add_argument("--n", type=int, help="prompts per measurement (default monitor.heldout_requests)")
    simulate.add_argument("--server", action="store_true",
                          help="simulate the window test of the serving engines' counters instead (monitor."
                               "server_*): windows resampled from --pairs (per-window accepted, draft tokens), else "
                               "from the window store's recorded windows, else synthetic")
    simulate.add_argument("--requests-per-window", type=int,
                          help="--server: synthetic windows of this many requests (the traffic of one window length)")
    simulate.add_argument("--window-sd", type=float, default=0.0,
                          help="--server: each window's acceptance shifted by N(0, sd) (traffic mix between windows)")
    simulate.add_argument("--daily-amplitude", type=float, default=0.0,
                          help="--server: a daily cycle of the windows' acceptance, +-this (with --window-hours)")
    simulate.add_argument("--window-hours", type=float, default=1.0, help="--server: hours per window (daily cycle)")
    simulate.add_argument("--replicas", type=int, default=1,
                          help="--server: each replica's test at monitor.level / (replicas + 1), as the check runs it")
    simulate.add_argument("--checks", type=int, help="simulated checks per point (default monitor.simulate_checks)")
    simulate.add_argument("--out", help="folder for simulation.json and power.png (default <state_dir>/simulation)")
    simulate.add_argument("--json", action="store_true")
    config_options(simulate)
    simulate.set_defaults(handler=simulate_command)


def _add_demo(actions) -> None:
    demo = actions.add_parser(
        "demo", help="drift demo: distill a champion, check, update the target, check (DRIFT), retrain, promote, "
                     "check (`make drift-demo`)")
    demo.add_argument("--out", default="outputs/drift-demo", help="folder for its configs, drafts, target, state")
    demo.add_argument("--serve", action="store_true",
                      help="through a running llama-server (`make serve-demo`, configs/serve_demo.yaml): deploy to it, "
                           "read its counters, roll the target update out to it, redeploy, check the recovery")
    demo.add_argument("--rehearse-mismatch", action="store_true",
                      help="--serve: also restart the engine with the old draft's file after a deploy "
                           "(DEPLOY_MISMATCH expected)")
    demo.add_argument("--no-speed", action="store_true", help="--serve: skip llama.cpp with/without the draft")
    demo.add_argument("--window-requests", type=int, default=6,
                      help="--serve: replayed requests per engine-check window")
    config_options(demo)
    demo.set_defaults(handler=demo_command)


def _add_rebaseline(actions) -> None:
    rebase = actions.add_parser("rebaseline", help="start the champion's server baseline afresh (recorded in MLflow "
                                "with who and why); a change of Prometheus source never does it by itself")
    rebase.add_argument("--by", required=True, help="who asks (recorded in MLflow)")
    rebase.add_argument("--reason", required=True, help="why (recorded in MLflow)")
    config_options(rebase)
    rebase.set_defaults(handler=rebaseline_command)


def _add_rollback(actions) -> None:
    rollback = actions.add_parser("rollback", help="move the champion alias back to the previous one")
    rollback.add_argument("--to-version", help="a specific version instead of the previous champion")
    config_options(rollback)
    rollback.set_defaults(handler=rollback_command)


def _add_deploy(actions) -> None:
    deploy = actions.add_parser(
        "deploy", help="export the champion into monitor.deploy.dir, switch `current` to it and reload the engine "
                       "(nothing when it is deployed); exit 0 done, 2 failed, 75 busy")
    deploy.add_argument("--force", action="store_true", help="export and reload again even where it is deployed")
    deploy.add_argument("--rollback", action="store_true",
                        help="switch `current` back to the previous deployment instead (the registry is unchanged)")
    config_options(deploy)
    deploy.set_defaults(handler=deploy_command)


def _add_target_finetune(subparsers) -> None:
    target = subparsers.add_parser("target", help="target model updates (to rehearse a target change)")
    actions = target.add_subparsers(dest="action", required=True)
    finetune = actions.add_parser(
        "finetune", help="fine-tune the target with LoRA on its own responses in another style, merge and save",
        description="The configured target answers prompts (target_update.prompts; distill's response cache is "
                    "reused), the responses are restyled (target_update.style), a LoRA adapter is trained on them "
                    "and merged, and the result is saved to target_update.output_dir as a new checkpoint.")
    config_options(finetune, overrides="e.g. target_update.steps=60 target_update.style=prefix")
    finetune.set_defaults(handler=target_finetune_command)


def _add_report(subparsers) -> None:
    report = subparsers.add_parser(
        "report", help="all versions of the registered draft side by side, and the monitor's last checks")
    report.add_argument("--model", default=None, help="registered model (default: tracking.registered_model)")
    report.add_argument("--format", choices=("md", "html"), default="md")
    report.add_argument("--out", default=None, help="write to this file instead of stdout")
    report.add_argument("--checks", type=int, default=10, help="how many monitor checks to list")
    config_options(report)
    report.set_defaults(handler=report_command)
