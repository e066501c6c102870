"""`jointrl` / `python -m driver`: validate the config, connect to Ray, start the driver, stream progress.

Exit status 2 for a bad config or value (nothing is started), 1 if training fails, 0 on success.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from driver.config import Config, ConfigError, load_config, run_config
from driver.metrics import progress_line


def parse_args(argv):
    p = argparse.ArgumentParser(prog="jointrl", description="Joint RL of N prompt refiners and one generator.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a preset or YAML config")
    where = t.add_mutually_exclusive_group()
    where.add_argument("--run-dir", default=None, help="where metrics, config and checkpoints go")
    where.add_argument("--resume", default=None, metavar="RUN_DIR",
                       help="continue a stopped run from its latest checkpoint, with its saved config")
    pre = sub.add_parser("pretrain", help="flow-match the base generator and text encoder (cached)")
    e = sub.add_parser("eval", help="strict accuracy per category on held-out and paraphrased prompts")
    which = e.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", help="a run directory (its latest checkpoint is evaluated)")
    which.add_argument("--base", help="a pretrained base folder (evaluated without refinement)")
    s = sub.add_parser("sample", help="refine a prompt with a run's refiners and draw it with its generator")
    s.add_argument("--run", required=True, help="a run directory (its latest checkpoint is used)")
    s.add_argument("--prompt", required=True, help="words of the task's vocabulary, e.g. 'a red circle'")
    s.add_argument("-n", type=int, default=4, help="images to draw (default 4)")
    s.add_argument("--seed", type=int, default=0, help="seeds the refiners' and generator's draws")
    s.add_argument("--out", default=None, help="the PNG to write (default RUN/samples/<prompt>-seed<S>.png)")
    r = sub.add_parser("report", help="plot a run's curves and samples as PNG files in RUN_DIR/report/")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with metrics.jsonl)")
    c = sub.add_parser("config", help="print a resolved config (show) or every key (keys), with descriptions")
    c.add_argument("action", choices=("show", "keys"),
                   help="show: the config of --config and --set, each key with its description and default; "
                        "keys: every dotted key with its type and description")
    for sp in (t, pre, e, c):
        sp.add_argument("--config", default=None, help="a preset name or a YAML path (default: shapes)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set trainer.steps=40 (repeatable)")
    args = p.parse_args(argv)
    if hasattr(args, "config") and not getattr(args, "resume", None):
        args.config = args.config or "shapes"
    return args


def config_error(error: ConfigError) -> int:
    print(f"jointrl: {error}", file=sys.stderr)
    return 2


def prepare_run(config: Config, run_dir: str | None, preset: str) -> Path:
    path = Path(run_dir or f"runs/{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (path / "metrics.jsonl").exists():
        raise ConfigError(f"--run-dir '{path}' already holds a run (metrics.jsonl); choose another "
                          f"folder so nothing already trained is overwritten")
    if config.trainer.run_name is None:
        config.trainer.run_name = path.resolve().name
    return path


def prepare_resume(run_dir: str, config_arg: str | None, overrides: list[str]) -> tuple[Config, Path, Path]:
    """The saved config (plus `overrides`) and the verified checkpoint a stopped run resumes from.
    Everything is checked before anything starts or is written."""
    from driver import checkpoint
    from experts.kinds import build_model
    path = Path(run_dir)
    if config_arg:
        raise ConfigError(f"--resume '{path}' trains with the run's saved config.yaml; drop --config "
                          f"'{config_arg}' (use --set to change a key)")
    config = run_config(path, "--resume", overrides)
    ckpt = checkpoint.latest(path)
    step = checkpoint.verify(ckpt, config.experts.ids())
    for eid in config.experts.ids():
        checkpoint.check_shapes(ckpt, eid, build_model(config, eid, fresh=True))
    if step >= config.trainer.steps:
        raise ConfigError(f"--resume '{path}': the run is complete ({step} of trainer.steps={config.trainer.steps}); "
                          f"raise it with --set trainer.steps=N to train further")
    return config, path, ckpt


class Progress:
    """A live progress line on a terminal; one plain line per step otherwise (CI, job logs)."""

    def __init__(self, total: int, done: int = 0):
        self.tty = sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True) if self.tty else None
        self.total = total

    def __call__(self, row: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(progress_line(row), refresh=False)
            self.bar.update(1)
        else:
            print(f"step {row['step'] + 1}/{self.total} {progress_line(row)}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(config: Config, run_dir: Path, resume: Path | None = None) -> dict:
    """Run training in the configured mode (from checkpoint `resume` if given), streaming progress;
    returns the driver's summary."""
    import ray

    from cluster.connect import connect
    from driver.checkpoint import step_of
    from driver.launch import follow, start_driver, stop_driver
    progress = Progress(config.trainer.steps, step_of(resume) if resume else 0)
    started_here = config.cluster.mode == "ray" and not ray.is_initialized()
    try:
        if config.cluster.mode == "inline":
            return start_driver(config, run_dir, resume).instance.run(on_row=progress)
        connect(config.cluster.address)
        driver = start_driver(config, run_dir, resume)
        try:
            done = driver.run.remote()
            follow(driver, done, progress)
            return ray.get(done)
        finally:
            stop_driver(driver)
    finally:
        progress.close()
        if started_here:
            ray.shutdown()


def evaluate(args) -> int:
    from driver.evaluate import evaluate_base, evaluate_run, table
    try:
        if args.run:
            report, where = evaluate_run(Path(args.run)), Path(args.run)
        else:
            where = Path(args.base)
            report = evaluate_base(load_config(args.config, args.overrides), where)
    except ConfigError as e:
        return config_error(e)
    print(f"jointrl: strict accuracy of {report['checkpoint']}\n{table(report)}\n"
          f"  written to {where / 'eval.json'}, samples in {where / 'eval_samples.png'}")
    return 0


def run_sample(args) -> int:
    from driver.sample import sample_run
    try:
        if args.n < 1:
            raise ConfigError(f"-n {args.n}: draw at least one image")
        drawn = sample_run(Path(args.run), args.prompt, args.n, args.seed, Path(args.out) if args.out else None)
    except ConfigError as e:
        return config_error(e)
    print(f"jointrl: {args.prompt!r} from {drawn['checkpoint']}")
    for i, refs in enumerate(drawn["refinements"]):
        print(f"  [{i}] " + ("; ".join(f"{e}: {words or '(nothing)'}" for e, words in refs.items()) or "not refined"))
    print(f"  images: {drawn['png']}")
    return 0


def run_report(args) -> int:
    from driver.report import report
    try:
        written = report(Path(args.run_dir))
    except ConfigError as e:
        return config_error(e)
    print(f"jointrl: report of {args.run_dir}\n" + "\n".join(f"  {p}" for p in written))
    return 0


def run_pretrain(args) -> int:
    from driver.evaluate import evaluate_base, table
    from driver.pretrain import base_dir, pretrain_all
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as e:
        return config_error(e)
    base = base_dir(config)
    print(f"jointrl: pretraining the base into {base} ({config.pretrain.steps} steps), then the "
          f"refiners ({config.pretrain.refiner_steps} steps)", flush=True)
    overrides, reused = pretrain_all(config)
    if reused:
        print(f"jointrl: reusing the cached base {base} and refiners (same config hash)")
    eval_file = base / "eval.json"
    report = json.loads(eval_file.read_text()) if eval_file.is_file() else evaluate_base(config, base)
    sets = " ".join(f"--set {o}" for o in overrides)
    print(f"{table(report)}\njointrl: base ready. Train from it with\n  {sets}")
    return 0


def run_train(args) -> int:
    resume = None
    try:
        if args.resume:
            config, run_dir, resume = prepare_resume(args.resume, args.config, args.overrides)
        else:
            config = load_config(args.config, args.overrides)
            run_dir = prepare_run(config, args.run_dir, args.config)
    except ConfigError as e:
        return config_error(e)
    print(f"jointrl: run '{config.trainer.run_name}' in {run_dir} ({config.cluster.mode} mode, "
          f"{len(config.experts.active_refiners())} refiners + generator, credit={config.algorithm.credit})"
          + (f", resuming from {resume}" if resume else ""), flush=True)
    try:
        summary = train(config, run_dir, resume)
    except Exception as e:  # the run dir keeps whatever was written: metrics so far, checkpoints
        cause = getattr(e, "cause", None) or e
        print(f"jointrl: training failed: {type(cause).__name__}: {cause}\n  run dir: {run_dir}", file=sys.stderr)
        return 1
    print(f"jointrl: done, {summary['steps']} steps, final {progress_line(summary['last'])}\n"
          f"  run dir:     {run_dir}\n  metrics:     {run_dir / 'metrics.jsonl'}\n"
          f"  config:      {run_dir / 'config.yaml'}\n  checkpoints: {run_dir / 'checkpoints'}", flush=True)
    return 0


def run_config_docs(args) -> int:
    """`jointrl config show|keys`: the schema's documentation; show skips the preflight checks, so a
    config that names models or files absent here can still be read."""
    from driver.config import resolve_config
    from driver.config_docs import keys, show
    if args.action == "keys":
        print(keys())
        return 0
    try:
        config = resolve_config(args.config, args.overrides)
    except ConfigError as e:
        return config_error(e)
    print(show(config))
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return {"train": run_train, "pretrain": run_pretrain, "eval": evaluate, "sample": run_sample,
            "report": run_report, "config": run_config_docs}[args.command](args)
