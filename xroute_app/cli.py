"""The ``xroute`` command line. Every user error ends in one readable line and exit code 2."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from cloud_adapters.cli import events_app, telemetry_app
from models.cli import promote, train, train_planner
from router.app.audit_cli import audit_app
from router.app.cli import export_feedback, export_ope, serve
from router.app.policy_cli import policies_app
from router.control.keys import cli as keys_app
from xroute.errors import ConfigError, XrouteError
from xroute_app.capacity import capacity_app

if TYPE_CHECKING:
    from xroute.config import EvaluateConfig

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="xroute: reinforcement-learning cross-cloud router.")


@app.callback()
def _root() -> None:
    """xroute: reinforcement-learning cross-cloud router."""


def _ts(value: str | None, option: str) -> str | None:
    if value is None:
        return None
    import pandas as pd

    try:
        pd.Timestamp(value)
    except (ValueError, TypeError):
        raise ConfigError(f"{option}: '{value}' is not an ISO-8601 timestamp (e.g. 2023-11-16T18:30:00Z)") from None
    return value


@app.command()
def evaluate(
    policy: Annotated[list[str], typer.Option("--policy", "-p", help="policy name (repeatable): static, "
                                              "static:OFFERING_ID, cheapest, lowest-latency, least-loaded, greedy, "
                                              "budget-pacing, cache-aware, session-sticky, round-robin, random, oracle, "
                                              "models:/NAME@ALIAS or a model path")],
    telemetry: Annotated[Path | None, typer.Option(help="bundle directory (default: the shipped bundle)")] = None,
    start: Annotated[str | None, typer.Option(help="first request time (ISO-8601, inclusive)")] = None,
    end: Annotated[str | None, typer.Option(help="last request time (ISO-8601, exclusive)")] = None,
    window: Annotated[str | None, typer.Option(help="train | validation | test: the time split `xroute train` "
                                               "uses (fractions from --train-config)")] = None,
    train_config: Annotated[Path | None, typer.Option(help="train config YAML for --window "
                                                      "(default configs/train.yaml)")] = None,
    sample: Annotated[int | None, typer.Option(help="a quick look: only this many requests, in evenly spaced "
                                               "contiguous blocks of the stream")] = None,
    seeds: Annotated[int | None, typer.Option(help="seeds per policy (default from config: 5); metrics are "
                                              "reported as mean and 95 % interval")] = None,
    rate_scale: Annotated[float, typer.Option(help="compress arrivals: 4 = four times the load")] = 1.0,
    output: Annotated[Path | None, typer.Option(help="JSON report path (default reports/evaluate-<UTC time>.json, "
                                                "never an earlier run's)")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG of the comparison (default: the report's path with .png)")] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="write no plot")] = False,
    config: Annotated[Path | None, typer.Option(help="evaluate config YAML (default configs/evaluate.yaml)")] = None,
    seed: Annotated[int | None, typer.Option(help="first seed (default from config)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress")] = False,
    policies: Annotated[Path | None, typer.Option(help="routing policies (docs/policies.md): a policy YAML file or "
                                                  "directory; every policy is evaluated under them and the report "
                                                  "counts what each excluded (default: the config's env.policies)")
                        ] = None,
    versus: Annotated[str | None, typer.Option(help="take the paired differences to this policy (one of --policy, "
                                               "e.g. greedy) rather than to the best baseline")] = None,
    swap_offerings: Annotated[float | None, typer.Option(help="swap this fraction of the bundle's offerings (e.g. 0.2) "
                                                         "for offerings no shipped bundle has, from --unseen-catalog: "
                                                         "how a trained router copes with a catalog it never saw")] = None,
    unseen_catalog: Annotated[Path | None, typer.Option(help="catalog directory --swap-offerings draws from "
                                                        "(default data/catalogs/unseen/<bundle name>)")] = None,
    swap_seed: Annotated[int, typer.Option(help="which offerings --swap-offerings swaps")] = 0,
    capacity: Annotated[bool, typer.Option("--capacity", help="compare capacity planners in the provisioning world "
                                           "(docs/capacity.md): --policy names planners (static-ondemand, autoscaler, "
                                           "spothedge, melange, oracle, or a learned one: "
                                           "models:/xroute-planner@champion, runs:/..., an export directory), --config a capacity config (default "
                                           "configs/capacity.yaml), --window defaults to test")] = False,
    load_scale: Annotated[int | None, typer.Option(help="with --capacity: the stream this many times over in the same "
                                                   "time, copy j delayed by j/N of an epoch (world.load_scale)")] = None,
) -> None:
    """Replay the same request stream through each policy, for several seeds, and compare them."""
    import pandas as pd

    from models import evaluate as ev
    from xroute.bundle import load_bundle

    if rate_scale <= 0:
        raise ConfigError(f"--rate-scale: must be > 0, got {rate_scale}")
    if seeds is not None and seeds < 1:
        raise ConfigError(f"--seeds: must be at least 1, got {seeds}")
    if load_scale is not None and not capacity:
        raise ConfigError("--load-scale: only with --capacity")
    if capacity:
        for flag, given in (("--sample", sample is not None), ("--policies", policies is not None),
                            ("--swap-offerings", swap_offerings is not None),
                            ("--unseen-catalog", unseen_catalog is not None)):
            if given:
                raise ConfigError(f"{flag}: not available with --capacity")
        _evaluate_capacity(policy, telemetry, start, end, window or "test", train_config, seeds, rate_scale, output,
                           plot, no_plot, config, seed, quiet, versus, load_scale)
        return
    if sample is not None and sample < 1:
        raise ConfigError(f"--sample: must be at least 1 request, got {sample}")
    cfg = _evaluate_config(config)
    env_upd: dict[str, object] = {"rate_scale": rate_scale, "episode_requests": None}
    if policies is not None:
        from xroute.config import load_policies

        env_upd["policies"] = load_policies(policies)
    upd: dict[str, object] = {"env": cfg.env.model_copy(update=env_upd)}
    if seed is not None:
        upd["seed"] = seed
    if seeds is not None:
        upd["seeds"] = seeds
    cfg = cfg.model_copy(update=upd)
    bundle = load_bundle(telemetry)
    swapped = None
    if unseen_catalog is not None and swap_offerings is None:
        raise ConfigError("--unseen-catalog: only with --swap-offerings (the fraction of offerings to swap)")
    if swap_offerings is not None:
        from xroute.catalog_tools import swap_catalog, unseen_catalog_dir

        donor = unseen_catalog if unseen_catalog is not None else unseen_catalog_dir(bundle)
        if not donor.is_dir():
            raise ConfigError(f"--unseen-catalog: {donor} is not a directory (build one with tools/build_default_bundle.py "
                              "--catalog unseen)")
        before_ids = set(bundle.offering_ids)
        bundle = swap_catalog(bundle, donor, swap_offerings, swap_seed)
        swapped = sorted(set(bundle.offering_ids) - before_ids)
        typer.echo(f"swapped {len(swapped)} of {len(before_ids)} offerings for unseen ones from {donor}")
    history = None
    if window is not None:
        from models.config import load_train_config
        from models.scenarios import SPLITS, split_bundle

        if window not in SPLITS:
            raise ConfigError(f"--window: '{window}' is not one of {', '.join(SPLITS)}")
        splits = split_bundle(bundle, load_train_config(train_config).split)
        # the routers start from the outputs of the requests before the window (known by then)
        before = [splits.bundles[w].workload for w in SPLITS[: SPLITS.index(window)]]
        history = pd.concat(before, ignore_index=True) if before else None
        bundle = splits.bundles[window]
    bundle = bundle.window(_ts(start, "--start"), _ts(end, "--end"))
    if sample is not None:
        bundle = bundle.select(ev.sample_rows(len(bundle.workload), sample))
    out = output if output is not None else ev.default_report_path()
    if versus is not None and versus not in policy:
        raise ConfigError(f"--versus: '{versus}' is not one of the --policy options ({', '.join(policy)})")
    results = ev.evaluate(bundle, list(dict.fromkeys(policy)), cfg, show_progress=not quiet, history=history,
                          versus=versus)
    unseen_share: dict[str, float] | None = None
    if swapped is not None:  # how much of each policy's traffic went to the offerings it never saw
        import numpy as np

        idx = np.flatnonzero(bundle.offerings["offering_id"].isin(swapped).to_numpy())
        unseen_share = {r.name: float(np.mean([np.isin(run.actions, idx).mean() for run in r.runs
                                               if run.actions is not None] or [float("nan")])) for r in results}
    span = bundle.time_span()
    end_fmt = "%H:%M" if span[0].date() == span[1].date() else "%Y-%m-%d %H:%M"
    what = f"{len(bundle.workload)} requests" + (f" (sample of {sample})" if sample is not None else "")
    ev.print_table(results, title=f"xroute evaluate — {bundle.path.name}, {what}, "
                                  f"{span[0]:%Y-%m-%d %H:%M}–{span[1].strftime(end_fmt)} UTC, rate x{rate_scale:g}")
    ev.write_json(ev.report_dict(results, bundle, cfg, {"start": str(span[0]), "end": str(span[1]),
                                                       "sample": sample, "window": window,
                                                       "swapped_in": swapped, "swap_seed": swap_seed
                                                       if swapped is not None else None,
                                                       "placed_on_swapped_in": unseen_share}), out)
    if unseen_share is not None:
        typer.echo("requests placed on the swapped-in offerings: " +
                   ", ".join(f"{k} {100 * v:.1f} %" for k, v in unseen_share.items()))
    typer.echo(f"report: {out}")
    if not no_plot:
        png = plot if plot is not None else out.with_suffix(".png")
        ev.plot(results, png, title=f"{bundle.path.name}, {what}, rate x{rate_scale:g}, {cfg.seeds} seed(s)")
        typer.echo(f"plot: {png}")


def _evaluate_capacity(planners: list[str], telemetry: Path | None, start: str | None, end: str | None, window: str,
                       train_config: Path | None, seeds: int | None, rate_scale: float, output: Path | None,
                       plot: Path | None, no_plot: bool, config: Path | None, seed: int | None, quiet: bool,
                       versus: str | None, load_scale: int | None = None) -> None:
    """``xroute evaluate --capacity``: the planners in the provisioning world (``models.capacity_eval``)."""
    from models import capacity_eval as ce
    from models import evaluate as ev
    from models.config import load_train_config
    from models.planner_policy import planner_factory
    from models.scenarios import SPLITS, split_bundle
    from xroute.bundle import load_bundle
    from xroute.config import CapacityConfig, config_path, load_config

    if versus is not None and versus not in planners:
        raise ConfigError(f"--versus: '{versus}' is not one of the --policy options ({', '.join(planners)})")
    cfg_file = config if config is not None else config_path("capacity.yaml")
    cfg = load_config(CapacityConfig, cfg_file)
    if load_scale is not None and load_scale < 1:
        raise ConfigError(f"--load-scale: must be at least 1, got {load_scale}")
    wupd: dict[str, object] = {"rate_scale": rate_scale}
    if load_scale is not None:
        wupd["load_scale"] = load_scale
    upd: dict[str, object] = {"world": cfg.world.model_copy(update=wupd)}
    if seed is not None:
        upd["seed"] = seed
    if seeds is not None:
        upd["seeds"] = seeds
    cfg = cfg.model_copy(update=upd)
    # an unknown planner fails before any work; a learned one is read (or downloaded) once
    factories = {name: planner_factory(name, cfg.planners) for name in dict.fromkeys(planners)}
    if window not in SPLITS:
        raise ConfigError(f"--window: '{window}' is not one of {', '.join(SPLITS)}")
    bundle = load_bundle(telemetry)
    splits = split_bundle(bundle, load_train_config(train_config).split)
    history = splits.history(window)
    win = splits.bundles[window].window(_ts(start, "--start"), _ts(end, "--end"))
    results, world = ce.evaluate_capacity(win, list(dict.fromkeys(planners)), cfg, history, versus=versus,
                                          progress=not quiet, factories=factories)
    span = win.time_span()
    title = (f"xroute evaluate --capacity — {win.path.name}, {window} window {span[0]:%Y-%m-%d %H:%M}–"
             f"{span[1]:%H:%M} UTC, {world.N} requests, rate x{rate_scale:g}, load x{cfg.world.load_scale}, {world.P} pools, "
             f"{world.E} epochs of {cfg.world.epoch_s:g} s")
    ce.print_table(results, title)
    out = output if output is not None else ev.default_report_path()
    ev.write_json(ce.report_dict(results, win, cfg, world, {"window": window, "start": str(span[0]),
                                                            "end": str(span[1])}), out)
    typer.echo(f"report: {out}")
    if not no_plot:
        png = plot if plot is not None else out.with_suffix(".png")
        ce.plot(results, world, png, title=f"{win.path.name} {window} window, rate x{rate_scale:g}, load "
                                           f"x{cfg.world.load_scale}: instances per pool (first seed) and the request rate")
        typer.echo(f"plot: {png}")


ope_app = typer.Typer(pretty_exceptions_enable=False, add_completion=False)


def _evaluate_config(config: Path | None) -> EvaluateConfig:
    """``--config``, else the evaluate config of the working directory's configs/ or the shipped one."""
    from xroute.config import EvaluateConfig, config_path, load_config

    cfg_file = config if config is not None else config_path("evaluate.yaml")
    return load_config(EvaluateConfig, cfg_file if Path(cfg_file).exists() or config is not None else None)


@ope_app.callback(invoke_without_command=True)
def ope(
    ctx: typer.Context,
    log: Annotated[Path | None, typer.Option(help="decision log: *.jsonl, *.jsonl.gz or *.parquet (docs/ope.md)")] = None,
    policy: Annotated[list[str] | None, typer.Option(
        "--policy", "-p", help="policy to estimate (repeatable): models:/NAME@ALIAS, runs:/…, an exported router "
                               "directory, or a baseline scored from the logged features: greedy, cheapest, "
                               "lowest-latency, least-loaded, random; any of them exploring as the router does: "
                               "NAME:epsilon=0.1")] = None,
    output: Annotated[Path | None, typer.Option(help="JSON report path (default reports/ope-<UTC time>.json)")] = None,
    config: Annotated[Path | None, typer.Option(help="evaluate config YAML: the reward when the log's header has "
                                                     "none (default configs/evaluate.yaml)")] = None,
    no_calibration: Annotated[bool, typer.Option("--no-calibration", help="DR's reward model: the plain reward "
                                                 "prior, not calibrated on the log")] = False,
) -> None:
    """Estimate policies' mean reward on the traffic of a decision log (off-policy): IPS, SNIPS and
    doubly robust, each with a 95 % interval, the effective sample size and the agreement with the
    logged actions. `xroute ope simulate` writes a log to try it on."""
    if ctx.invoked_subcommand is not None:
        return
    if log is None:
        raise ConfigError("--log: required (a decision log; `xroute ope simulate --out log.parquet` writes one)")
    if not policy:
        raise ConfigError("--policy: give at least one, e.g. --policy models:/xroute-router@challenger")
    import time

    from models import ope as o
    from models.evaluate import write_json
    from xroute.schema.ope import read_log

    cfg = _evaluate_config(config)
    lg = read_log(log)
    o.check_layout(lg)
    if lg.n == 0:
        raise ConfigError(f"--log: {log} has no decision with a reward yet ({lg.pending} pending)")
    prior = o.reward_prior(lg.header, cfg.env)
    targets = [o.resolve_target(p, prior, cfg) for p in dict.fromkeys(policy)]
    q = o.q_hat(lg, prior, calibrate=not no_calibration)
    rep = o.report_dict(lg, [o.evaluate_target(lg, t, q, model=m) for t, m in targets], not no_calibration)
    o.print_table(rep, typer.echo)
    out = output if output is not None else Path("reports") / time.strftime("ope-%Y%m%dT%H%M%SZ.json", time.gmtime())
    write_json(rep, out)
    typer.echo(f"report: {out}")


@ope_app.command("simulate")
def ope_simulate(
    out: Annotated[Path, typer.Option(help="the log to write: *.parquet, *.jsonl or *.jsonl.gz")],
    telemetry: Annotated[Path | None, typer.Option(help="bundle directory (default: the shipped bundle)")] = None,
    epsilon: Annotated[float, typer.Option(help="exploration: a uniformly drawn offering with this probability, "
                                                "greedy's otherwise")] = 0.1,
    seeds: Annotated[int, typer.Option(help="episodes over the stream (seed, seed + 1, …)")] = 1,
    seed: Annotated[int, typer.Option(help="first seed")] = 0,
    rate_scale: Annotated[float, typer.Option(help="compress arrivals; below 1 for light load, where one "
                                                   "decision barely affects the next")] = 1.0,
    sample: Annotated[int | None, typer.Option(help="only this many requests (evenly spaced blocks)")] = None,
    config: Annotated[Path | None, typer.Option(help="evaluate config YAML (default configs/evaluate.yaml)")] = None,
) -> None:
    """Write a simulated decision log: the bundle's requests routed epsilon-greedy around greedy,
    with exact propensities and realized rewards — to try `xroute ope` without a router."""
    from models import evaluate as ev
    from models import ope as o
    from xroute.bundle import load_bundle
    from xroute.schema.ope import SUFFIXES, write_log

    if not out.name.endswith(SUFFIXES):
        raise ConfigError(f"--out: '{out}': a decision log is named *.parquet, *.jsonl or *.jsonl.gz")
    if seeds < 1:
        raise ConfigError(f"--seeds: must be at least 1, got {seeds}")
    if rate_scale <= 0:
        raise ConfigError(f"--rate-scale: must be > 0, got {rate_scale}")
    if sample is not None and sample < 1:
        raise ConfigError(f"--sample: must be at least 1 request, got {sample}")
    cfg = _evaluate_config(config)
    env_cfg = cfg.env.model_copy(update={"rate_scale": rate_scale, "episode_requests": None})
    bundle = load_bundle(telemetry)
    if sample is not None:
        bundle = bundle.select(ev.sample_rows(len(bundle.workload), sample))
    sim = o.simulate_log(bundle, env_cfg, epsilon, range(seed, seed + seeds))
    write_log(out, sim.header, sim.records)
    mean = sum(r.reward or 0.0 for r in sim.records) / max(len(sim.records), 1)
    typer.echo(f"wrote {len(sim.records)} decisions to {out} (logged mean reward {mean:.4f}; {sim.skipped} requests "
               "had no valid offering and are not logged)")


@app.command()
def plan(
    policy: Annotated[str, typer.Option("--policy", "-p", help="the planner: static-ondemand, autoscaler, spothedge, "
                                        "melange, or a learned one: models:/xroute-planner@champion (or "
                                        "@challenger), runs:/..., an export directory")] = "spothedge",
    telemetry: Annotated[Path | None, typer.Option(help="bundle directory (default: the shipped bundle); with --live "
                                                   "the directory xroute telemetry collect --out keeps current")] = None,
    live: Annotated[bool, typer.Option("--live", help="read --telemetry as a live collector's directory (no workload "
                                       "table needed); --at defaults to now")] = False,
    at: Annotated[str | None, typer.Option(help="plan time, ISO-8601 (default: the bundle's last request; now with "
                                           "--live)")] = None,
    output: Annotated[Path | None, typer.Option(help="write the CapacityPlan JSON here (xroute/schema/capacity.py)")
                      ] = None,
    config: Annotated[Path | None, typer.Option(help="capacity config YAML: the world and the planners' knobs "
                                                "(default configs/capacity.yaml)")] = None,
    all_pools: Annotated[bool, typer.Option("--all", help="list every pool, not only those with a target or "
                                            "instances now")] = False,
) -> None:
    """The target instances per pool now, beside what runs, with the reasons (docs/capacity.md, "Planning in the
    service"): a table, and the plan's JSON with --output."""
    import time

    from models.capacity_plan import PlanMaker, plan_table
    from xroute.bundle import load_bundle, to_seconds
    from xroute.config import CapacityConfig, config_path, load_config

    when = _plan_time(at)
    cfg = load_config(CapacityConfig, config if config is not None else config_path("capacity.yaml"))
    if live:
        from router.decision.telemetry import LiveSource

        if telemetry is None:
            raise ConfigError("--live: needs --telemetry DIR (the directory xroute telemetry collect --out writes)")
        bundle, source = LiveSource(telemetry).bundle(), f"live:{telemetry}"
        when = time.time() if when is None else when
    else:
        bundle = load_bundle(telemetry)
        source = f"{bundle.path.name}@{bundle.content_hash}"
        when = float(to_seconds(bundle.workload["ts"])[-1]) if when is None else when
    maker = PlanMaker(bundle, policy, cfg, source)
    out = maker.plan(when)
    _print_plan(out, *plan_table(out, all_pools))
    if output is not None:
        _write_atomic(output, out.model_dump_json(indent=2) + "\n")
        typer.echo(f"plan: {output}")


def _plan_time(at: str | None) -> float | None:
    """``--at`` as seconds since the epoch (a time without a zone is UTC); one line naming it otherwise."""
    if at is None:
        return None
    import pandas as pd

    try:
        ts = pd.Timestamp(_ts(at, "--at"))
    except ValueError:
        raise ConfigError(f"--at: '{at}' is not an ISO-8601 timestamp (e.g. 2023-11-16T18:30:00Z)") from None
    if ts is pd.NaT:
        raise ConfigError(f"--at: '{at}' is not a time")
    return float((ts.tz_localize("UTC") if ts.tzinfo is None else ts).timestamp())


def _print_plan(plan: object, head: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from xroute.schema.capacity import CapacityPlan

    assert isinstance(plan, CapacityPlan)
    t = Table(title=f"xroute plan -- {plan.planner} at {plan.at.isoformat()} ({plan.source})",
              caption=f"{len(rows)} of {len(plan.pools)} pools; targets cost {plan.usd_per_hour:.2f} USD/h at plan-time "
                      "prices; current: instances running (? = no inventory)")
    for c in head:
        t.add_column(c, justify="left" if c in ("pool", "mode", "reason") else "right")
    for r in rows:
        t.add_row(*r)
    Console(width=200).print(t)


def _write_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` whole or not at all (a temporary file beside it, fsynced, renamed over it)."""
    import os
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# commands owned by the other packages (their modules import only typer at top level)
app.command()(train)
app.command("train-planner")(train_planner)
app.command()(promote)
app.command()(serve)
app.command(name="export-feedback")(export_feedback)
app.command(name="export-ope")(export_ope)
app.add_typer(ope_app, name="ope", help="Off-policy evaluation from a decision log (docs/ope.md).")
app.add_typer(telemetry_app, name="telemetry", help="Collect telemetry from cloud accounts into a bundle.")
app.add_typer(events_app, name="events", help="Preemption notices from an instance's metadata service to the router "
                                              "(docs/migration.md).")
app.add_typer(capacity_app, name="capacity", help="Set the cloud groups toward a capacity plan, within quotas, a "
                                                  "USD/hour limit and a step limit; dry run unless --apply "
                                                  "(docs/capacity.md).")
app.add_typer(keys_app, name="keys", help="The router's API keys: add, list, revoke (docs/router.md).")
app.add_typer(audit_app, name="audit", help="The audit log: export it as JSON lines for a SIEM "
                                            "(docs/observability.md).")
app.add_typer(policies_app, name="policies", help="Routing policies: validate, apply, show, audit, export to Rego "
                                                  "(docs/policies.md).")


def main() -> None:
    try:
        app()
    except XrouteError as e:
        typer.echo(f"xroute: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("xroute: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
