"""`jointrl` / `python -m driver`: validate the config, connect to Ray, start the driver, stream progress.

Exit status: 0 on success; 2 for a bad config or value (nothing is started), or an actor that could
not start because of a setting (a model that cannot be loaded, a refused setting); 1 if training
fails otherwise; 3 when the rewards failed on every sample of `reward.max_failed_steps` steps in a
row (the run checkpointed its last step and can be resumed once the reward is fixed); 130, 143 and
129 when SIGINT, SIGTERM or SIGHUP stopped it (checkpointed, resumable; also when Ray ended before
that checkpoint could be written: the line then names the last one that exists).
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import signal
import sys
import time
from pathlib import Path

from tqdm import tqdm

from cluster.startup import start_failure
from common.config import SettingError
from common.loading import one_line
from driver.config import Config
from driver.preflight import load_config, run_config
from driver.interrupts import EXIT_CODES
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
    pre.add_argument("--refiners", action="store_true", help="only the refiners' supervised starts (cached): "
                                                             "for refiners of other settings beside a base already made")
    e = sub.add_parser("eval", help="every reward term (and GenEval-style strict accuracy) per tag on the task's "
                                    "evaluation sets, with and without refinement")
    e.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory (its latest checkpoint is evaluated)")
    e.add_argument("--base", help="a pretrained base folder instead of a run (evaluated without refinement)")
    e.add_argument("--run", help=argparse.SUPPRESS)  # the form before RUN_DIR, taken for one release
    e.add_argument("--no-refine", action="store_true", help="only unrefined prompts (evaluation.refine=false)")
    s = sub.add_parser("sample", help="refine a prompt with a run's refiners and draw it with its generator")
    s.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory (its latest checkpoint is used)")
    s.add_argument("--run", help=argparse.SUPPRESS)  # the form before RUN_DIR, taken for one release
    s.add_argument("--prompt", required=True, help="words of the task's vocabulary, e.g. 'a red circle'")
    s.add_argument("-n", type=int, default=4, help="images to draw (default 4)")
    s.add_argument("--seed", type=int, default=0, help="seeds the refiners' and generator's draws")
    s.add_argument("--out", default=None, help="the PNG to write (default RUN/samples/<prompt>-seed<S>.png); a video "
                                                  "task's clips: this name as .gif (and .mp4)")
    r = sub.add_parser("report", help="plot a run's curves and samples as PNG files in RUN_DIR/report/")
    r.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (with metrics.jsonl)")
    c = sub.add_parser("config", help="print a resolved config (show) or every key (keys), with descriptions")
    c.add_argument("action", choices=("show", "keys"),
                   help="show: the config of --config and --set, each key with its description and default; "
                        "keys: every dotted key with its type and description")
    d = sub.add_parser("download", help="fetch every hub model the config names into the Hugging Face cache "
                                        "(HF_HOME / HF_HUB_CACHE), so that the run reads it from there")
    d.add_argument("--list", action="store_true", help="print the models and an `hf download` line for each; "
                                                       "fetch nothing")
    sc = sub.add_parser("score", help="score a folder of images (one per prompt) with one reward term: per-image "
                                      "scores and their mean, to check a reward before training with it")
    sc.add_argument("--term", required=True, metavar="NAME",
                    help="a reward term of the config, or a built-in (ocr, geneval, clip_score, …) with its default "
                         "options where the config has none of that name; change its options with "
                         "--set reward.terms.NAME.KEY=VALUE")
    sc.add_argument("--prompts", required=True, metavar="FILE",
                    help="the prompts, one per image (.txt a line each; .jsonl with metadata, e.g. GenEval's)")
    sc.add_argument("--images", required=True, metavar="DIR",
                    help="PNG/JPEG images, paired with the prompts in name order (numbers by value: 2.png before "
                         "10.png)")
    sc.add_argument("--json", action="store_true", help='print {"term", "mean", "scores", "files"[, "strict"]} '
                                                        "as JSON instead of the table")
    pl = sub.add_parser("plan", help="the memory plan of a config: per actor and per GPU, from its models' real "
                                     "architectures (nothing is downloaded); exit 2 if it cannot fit")
    pl.add_argument("--gpus", type=int, default=None, help="GPUs per node of the target (default: the connected Ray "
                                                           "cluster's, else plan.target.gpus_per_node)")
    pl.add_argument("--gpu-memory", type=float, default=None, metavar="GB", help="memory of each GPU in GB (default: "
                                                                                "plan.target.gpu_memory_gb)")
    pl.add_argument("--nodes", type=int, default=None, help="nodes of the target (default: plan.target.nodes)")
    pl.add_argument("--json", action="store_true", help="print the plan as JSON: per actor gpus, params, bytes")
    pl.add_argument("--place", action="store_true", help="reserve the plan's placement on Ray (a private local Ray "
                                                         "declaring the target's GPUs when no cluster is named), start "
                                                         "one placeholder per actor, report the GPU ids Ray gives each "
                                                         "beside the plan's, then release everything")
    x = sub.add_parser("export", help="a run's trained models as diffusers, transformers and PEFT load them, with a "
                                      "model card (driver/commands/export.py)")
    x.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (its latest checkpoint, or --step's)")
    x.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder to write into")
    x.add_argument("--step", type=int, default=None, help="the checkpoint of this step (default: the latest)")
    x.add_argument("--merge-lora", action="store_true", help="merge each LoRA adapter into its base and write the "
                                                             "whole model (default: the adapter alone)")
    sv = sub.add_parser("serve-reward", help="serve one reward term over HTTP, for runs whose term is fn: http "
                                             "(driver/commands/serve_reward.py; the protocol: tasks/rewards/http.py)")
    sv.add_argument("--term", required=True, metavar="NAME", help="a reward term of the config, or a built-in with "
                                                                  "its default options")
    sv.add_argument("--host", default="127.0.0.1", help="the address to bind (default the loopback; any other "
                                                         "requires JOINTRL_REWARD_TOKEN)")
    sv.add_argument("--port", type=int, default=8700, help="the port (0: any free one, printed)")
    sv.add_argument("--max-request-mb", type=float, default=256.0, help="larger requests are refused (413)")
    for sp in (t, pre, e, s, r, c, sc, d, pl, x, sv):
        sp.add_argument("--config", default=None, help="a preset name or a YAML path (default: shapes; on a run, "
                                                       "its keys are applied on top of the run's saved config)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set trainer.steps=40 (repeatable)")
    args = p.parse_args(argv)
    if args.command in ("eval", "sample"):
        run_given_once(p, args)
    on_a_run = getattr(args, "resume", None) or getattr(args, "run_dir", None) and args.command != "train"
    if not on_a_run:
        args.config = args.config or "shapes"
    return args


def run_given_once(parser, args) -> None:
    """Every command that reads a run takes it as RUN_DIR; `--run RUN_DIR`, the form eval and sample
    took before, still works for one release, with a one-line note (exit 2 for both, or neither)."""
    if args.run is not None:
        if args.run_dir is not None:
            parser.error(f"{args.command}: give the run once, as RUN_DIR (not also --run)")
        print(f"jointrl: note: `jointrl {args.command} --run RUN_DIR` is now `jointrl {args.command} RUN_DIR`; "
              f"--run goes in the next release", file=sys.stderr)
        args.run_dir = args.run
    if args.command == "eval" and (args.run_dir is None) == (args.base is None):
        parser.error("eval: give a RUN_DIR, or --base DIR for a pretrained base (one of them)")
    if args.command == "sample" and args.run_dir is None:
        parser.error("sample: give the RUN_DIR to draw from")


REWARDS_FAILED = 3  # the exit status of a run stopped because its rewards kept failing


def config_error(error: SettingError) -> int:
    print(f"jointrl: {error}", file=sys.stderr)
    return 2


def run_path(run_dir: str | None, preset: str) -> Path:
    """`run_dir`, or a new folder named after the preset and the time: claimed by creating it, with
    a suffix where a run started in the same second has it already."""
    if run_dir:
        return Path(run_dir)
    stem = Path("runs") / f"{Path(preset).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def prepare_run(config: Config, path: Path) -> Path:
    """Refuse a folder that holds a run already (or what one left); name the run after its folder."""
    for left, what in (("metrics.jsonl", "a run (metrics.jsonl)"), ("checkpoints", "a run's checkpoints"),
                       ("config.yaml", "the config.yaml of a run that stopped before its first step")):
        if (path / left).exists():
            raise SettingError(f"--run-dir '{path}' already holds {what}; choose another folder so nothing "
                              f"already trained is overwritten (or continue it: jointrl train --resume {path})")
    if config.trainer.run_name is None:
        config.trainer.run_name = path.resolve().name
    return path


def prepare_resume(path: Path, config_arg: str | None, overrides: list[str]) -> tuple[Config, Path]:
    """The saved config (plus `overrides`) and the verified checkpoint a stopped run resumes from.
    Everything is checked before anything starts or is written: an override may not change what
    the run's weights were made with (models, frozen parts included, their init, the seed)."""
    from driver import checkpoint
    from experts.kinds import build_model
    if config_arg:
        raise SettingError(f"--resume '{path}' trains with the run's saved config.yaml; drop --config "
                          f"'{config_arg}' (use --set to change a key)")
    config = run_config(path, "--resume", overrides)
    ckpt = checkpoint.latest(path)
    step = checkpoint.verify(ckpt, config.experts.ids())
    for eid in config.experts.ids():
        checkpoint.check_shapes(ckpt, eid, build_model(config, eid, fresh=True))
    if overrides:  # what a checkpoint's shapes cannot show
        refuse_weight_changes(run_config(path, "--resume"), config, path)
    if step >= config.trainer.steps:
        raise SettingError(f"--resume '{path}': the run is complete ({step} of trainer.steps={config.trainer.steps}); "
                          f"raise it with --set trainer.steps=N to train further")
    return config, ckpt


WEIGHT_KEYS = re.compile(r"(experts\.(n_refiners|generator_only|text_encoder\..*|(refiners\.\d+|generator)\."
                         r"(model\..*|init|max_new_tokens))|task\.(name|image_size)|trainer\.seed)")


def refuse_weight_changes(saved: Config, resumed: Config, path: Path) -> None:
    """Raise naming the first key an override changed among those that shape the run's weights."""
    from driver.overrides import flat
    before, after = flat(saved.model_dump()), flat(resumed.model_dump())
    for key in sorted(set(before) | set(after)):
        if WEIGHT_KEYS.fullmatch(key) and before.get(key) != after.get(key):
            raise SettingError(f"--resume '{path}': --set {key} changes what the run's weights were made with "
                              f"({before.get(key)!r} -> {after.get(key)!r}); a resumed run keeps its models, their "
                              f"frozen parts and its seed. Start a new run for another one. Nothing was started.")


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


def train(config: Config, run_dir: Path, interrupts, resume: Path | None = None) -> dict:
    """Run training in the configured mode (from checkpoint `resume` if given), streaming progress,
    stopped by the signals `interrupts` (installed by the caller) receives; returns the driver's
    summary. A signal that came before the driver is up stops the run before its first step, and
    before anything starts where Ray was not yet reached (the summary's `checkpoint` is then None).
    Where Ray ends under the run, the summary has `ray_gone` instead (said at once, in one line)."""
    import ray

    from cluster.connect import RayGone, connect_to, end_private_ray
    from driver.checkpoint import step_of
    from driver.launch import start_driver
    from driver.preflight import fits_cluster
    start = step_of(resume) if resume else 0
    not_started = {"steps": start, "stopped": True, "rewards_failed": None, "checkpoint": None}
    progress = Progress(config.trainer.steps, start)
    started_here = config.cluster.mode == "ray" and not ray.is_initialized()
    try:
        if interrupts.requested:
            return not_started
        if config.cluster.mode == "inline":
            driver = start_driver(config, run_dir, resume)
            interrupts.forward(driver.instance.stop)
            return driver.instance.run(on_row=progress)
        connect_to(config.cluster.address, None if config.logging.ray_verbose else run_dir / "ray.log",
                   config.cluster)
        if interrupts.requested:
            return not_started
        fits_cluster(config)
        return follow_on_ray(start_driver(config, run_dir, resume), interrupts, progress)
    except RayGone as gone:  # said now: ending a Ray that lost a process takes Ray a while
        print(f"jointrl: {ray_gone_line(gone, interrupts, run_dir)}", file=sys.stderr, flush=True)
        return {"ray_gone": str(gone)}
    finally:
        progress.close()
        if started_here:
            end_private_ray()


def follow_on_ray(driver, interrupts, progress: Progress) -> dict:
    """The summary of the run of `driver` (a Ray actor, started), streaming its rows to `progress`;
    a signal (`interrupts`) sends it `stop` at the next look (every 0.1 s). Its actors are stopped
    at the end, unless Ray itself is gone (RayGone)."""
    import ray

    from cluster.connect import RayGone
    from cluster.runtime import get
    from driver.launch import follow, stop_driver
    reachable = True
    try:
        if interrupts.requested:  # it came while the driver started
            get(driver.stop.remote())
        done = driver.run.remote()
        seen = follow(driver, done, progress, until=lambda _: interrupts.requested)
        if interrupts.requested:
            driver.stop.remote()
            follow(driver, done, progress, seen=seen)
        return ray.get(done)
    except RayGone:
        reachable = False
        raise
    except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError, ConnectionError) as e:
        reachable = False
        raise RayGone(f"the driver actor could not be reached ({one_line(e)})") from e
    finally:
        if reachable:
            stop_driver(driver)


def evaluate(args) -> int:
    from driver.commands.evaluate import evaluate_base, evaluate_run, table
    overrides = [*args.overrides, *(["evaluation.refine=false"] if args.no_refine else [])]
    with tqdm(desc="jointrl eval", unit="image", file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        if args.run_dir:
            where = Path(args.run_dir)
            report = evaluate_run(where, run_config(where, "RUN_DIR", overrides, layer=args.config), bar.update)
        else:
            where = Path(args.base)
            report = evaluate_base(load_config(args.config, ["experts.base=null", *overrides]), where, bar.update)
    pictures = sorted(p for p in where.glob("eval_s*.*") if p.stem in ("eval_samples", "eval_sheet"))
    print(f"jointrl: evaluation of {report['checkpoint']}\n{table(report)}\n"
          f"  written to {where / 'eval.json'}; images in {' and '.join(map(str, pictures))}")
    return 0


def run_sample(args) -> int:
    from driver.commands.sample import sample_run
    if args.n < 1:
        raise SettingError(f"-n {args.n}: draw at least one image")
    run = Path(args.run_dir)
    drawn = sample_run(run, run_config(run, "RUN_DIR", args.overrides, layer=args.config), args.prompt, args.n,
                       seed=args.seed, out=Path(args.out) if args.out else None)
    print(f"jointrl: {args.prompt!r} from {drawn['checkpoint']}")
    for i, refs in enumerate(drawn["refinements"]):
        print(f"  [{i}] " + ("; ".join(f"{e}: {words or '(nothing)'}" for e, words in refs.items()) or "not refined"))
    print(f"  images: {', '.join(map(str, drawn['files']))}")
    return 0


def run_report(args) -> int:
    from driver.commands.report import report
    run = Path(args.run_dir)
    written, missing = report(run, lambda: run_config(run, "report", args.overrides, layer=args.config))
    print(f"jointrl: report of {args.run_dir}\n" + "\n".join(f"  {p}" for p in written)
          + (f"\n  no samples: {missing}" if missing else ""))
    return 0


def run_pretrain(args) -> int:
    from driver.bases import base_dir
    from driver.commands.evaluate import evaluate_base, table
    from driver.commands.pretrain import pretrain_all, pretrain_refiner
    config = load_config(args.config, ["experts.base=null", *args.overrides])  # it makes the base
    if args.refiners:
        for eid in config.experts.active_refiners():
            path, reused = pretrain_refiner(config, eid)
            print(f"jointrl: {eid}'s supervised start {'reused' if reused else 'made'}: --set experts.{eid}.init={path.resolve()}")
        return 0
    base = base_dir(config)
    print(f"jointrl: pretraining the base into {base} ({config.pretrain.steps} steps), then the "
          f"refiners ({config.pretrain.refiner_steps} steps)", flush=True)
    overrides, reused = pretrain_all(config)
    if reused:
        print(f"jointrl: reusing the cached base {base} and refiners (same config hash)")
    eval_file = base / "eval.json"
    report = json.loads(eval_file.read_text()) if eval_file.is_file() else evaluate_base(config, base)
    sets = " ".join(f"--set {o}" for o in overrides)
    print(f"{table(report)}\njointrl: base ready. Train from it with\n  --set experts.base={base.parent.resolve()}\n"
          f"or name each file:\n  {sets}")
    return 0


def run_train(args) -> int:
    """Train, or resume; signals are handled from before the run's folder is prepared until the
    command has said how the run ended (driver/interrupts.py)."""
    from driver.interrupts import Interrupts
    with Interrupts() as interrupts:
        return train_command(args, interrupts)


def train_command(args, interrupts) -> int:
    from driver.checkpoint import step_of
    from driver.run_lock import run_lock
    if args.resume:
        path, config = Path(args.resume), None
        if not (path / "config.yaml").is_file():
            run_config(path, "--resume")  # the error naming what is missing
    else:
        config = load_config(args.config, args.overrides)
        path = run_path(args.run_dir, args.config)
    with run_lock(path, "--resume" if args.resume else "--run-dir"):
        if args.resume:
            config, resume = prepare_resume(path, args.config, args.overrides)
        else:
            resume = None
            prepare_run(config, path)
        print(f"jointrl: run '{config.trainer.run_name}' in {path} ({config.cluster.mode} mode, "
              f"{len(config.experts.active_refiners())} refiners + generator, credit={config.algorithm.credit})"
              + (f", resuming from {resume}" if resume else ""), flush=True)
        try:
            summary = train(config, path, interrupts, resume)
        except (SettingError, KeyboardInterrupt):
            raise
        except Exception as e:  # the run dir keeps whatever was written: metrics so far, checkpoints
            if (failed := start_failure(e)) is not None:  # one paragraph; Ray's tracebacks go to the log
                print(f"jointrl: {failed.paragraph(log_traceback(path, e))}", file=sys.stderr)
                return failed.exit_code
            cause = getattr(e, "cause", None) or e
            print(f"jointrl: training failed: {failure(cause)}\n  run dir: {path}", file=sys.stderr)
            return 1
    if "ray_gone" in summary:  # said as it was found
        return interrupts.exit_code if interrupts.requested else 1
    if summary["checkpoint"] is None:
        print(f"jointrl: stopped by {interrupts.name} while the run was starting, before anything was trained; "
              + (f"it keeps its checkpoint {resume}; resume with: jointrl train --resume {path}" if resume else
                 f"{path} holds no run: start it again with the same command"), flush=True)
        return interrupts.exit_code
    if summary["rewards_failed"]:
        print(f"jointrl: stopped after step {summary['steps']} of {config.trainer.steps}: "
              f"{summary['rewards_failed']}. Nothing already trained is lost: checkpoint {summary['checkpoint']}\n"
              f"  resume with: jointrl train --resume {path}  (with --set reward.terms.<name>.… to fix the term)",
              file=sys.stderr, flush=True)
        return REWARDS_FAILED
    if summary["stopped"]:
        trained = summary["steps"] > (step_of(resume) if resume else 0)
        done = f"after step {summary['steps']}" if trained else "before training a step"
        print(f"jointrl: stopped by {interrupts.name} {done} of {config.trainer.steps}; "
              f"checkpoint {summary['checkpoint']}\n  resume with: jointrl train --resume {path}", flush=True)
        return interrupts.exit_code
    if interrupts.requested:
        print(f"jointrl: {interrupts.name} came as the last step ended: the run is complete", flush=True)
    print(f"jointrl: done, {summary['steps']} steps, final {progress_line(summary['last'])}\n"
          f"  run dir:     {path}\n  metrics:     {path / 'metrics.jsonl'}\n"
          f"  config:      {path / 'config.yaml'}\n  checkpoints: {path / 'checkpoints'}", flush=True)
    if config.logging.report:
        print(report_lines(path, config), flush=True)
    return 0


def ray_gone_line(gone, interrupts, run_dir: Path) -> str:
    """One line: Ray ended under the run (after a signal: before the stop's checkpoint was
    written), the last checkpoint that exists and how to resume from it."""
    from driver.checkpoint import all_checkpoints, step_of
    saved = all_checkpoints(run_dir)
    kept = (f"the last checkpoint is {saved[-1]} (step {step_of(saved[-1])}); resume with: jointrl train "
            f"--resume {run_dir}" if saved else f"no checkpoint was written, so {run_dir} cannot be resumed")
    if interrupts.requested:
        return f"stopped by {interrupts.name}, but Ray ended before the checkpoint could be written ({gone}); {kept}"
    return f"training failed: Ray ended under the run ({gone}); {kept}"


def report_lines(run_dir: Path, config: Config) -> str:
    """The run's report written, and the two pictures to open first: the rewards and the samples."""
    from driver.commands.report import report
    written, missing = report(run_dir, lambda: config)
    first = [p for p in written if p.name in ("rewards.png", "samples.png", "samples.gif")]
    return (f"jointrl: report in {run_dir / 'report'} ({len(written)} pictures); open first:\n"
            + "\n".join(f"  {p}" for p in first) + (f"\n  no samples: {missing}" if missing else ""))


def log_traceback(run_dir: Path, error: BaseException) -> Path:
    """Append `error`'s whole traceback (a Ray error's holds every remote one) to the run's log,
    RUN_DIR/ray.log; returns its path."""
    import traceback
    log = run_dir / "ray.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} jointrl: the run could not start:\n"
                + "".join(traceback.format_exception(error)))
    return log


def failure(cause: BaseException) -> str:
    """A failure in one line; out of memory and a full disk are said as such (not a bug)."""
    import errno
    if isinstance(cause, MemoryError) or "out of memory" in str(cause).lower():
        return f"out of memory ({type(cause).__name__}); lower the batch (trainer.prompts_per_step, " \
               f"algorithm.group_size) or the models' size. The last complete checkpoint is intact."
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        return f"the disk is full ({cause.filename or cause}); free space and resume: the last complete " \
               f"checkpoint is intact."
    return f"{type(cause).__name__}: {cause}"


def run_download(args) -> int:
    """`jointrl download`: the config's hub models into this machine's Hugging Face cache (each
    node's, unless HF_HOME is on storage the nodes share); 1 if any could not be fetched."""
    from driver.config import resolve_config
    from driver.download import download, hub_models
    config = resolve_config(args.config, args.overrides)  # the schema only: the run's files need not be here
    if args.list:
        for model in hub_models(config):
            print(f"{model}\n  {model.hf_command()}")
        return 0
    failed = download(config, on_model=lambda line: print(f"jointrl: fetched {line}", flush=True))
    for line in failed:
        print(f"jointrl: cannot fetch {line}", file=sys.stderr)
    return 1 if failed else 0


def run_plan(args) -> int:
    """`jointrl plan`: the plan, as a report or JSON; with --place, the placement Ray gives it."""
    from driver.config import resolve_config
    from driver.commands.layout_plan import compare, compare_json, compare_report
    from driver.plan import PlanError, plan_for, report, target_for
    from experts.measurements import version_notes
    config = resolve_config(args.config, args.overrides)
    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes), ("--gpu-memory", args.gpu_memory)):
        if value is not None and (value < 0 or flag != "--gpus" and value <= 0):
            raise PlanError(f"{flag} {value}: must be {'at least 0' if flag == '--gpus' else 'positive'}")
    plan = plan_for(config, target_for(config, args.gpus, args.gpu_memory, args.nodes))
    placed = placed_env = None
    if args.place:
        from cluster.place_check import placed_ids
        from cluster.placement import PlacementError
        try:
            placed, placed_env = placed_ids(config, plan.gpu_groups(), plan.target.gpus,
                                            verbose=config.logging.ray_verbose)
        except PlacementError as e:
            raise PlanError(f"--place: {e}; everything reserved was released") from None
    layouts = compare(config, plan.target)
    for note in version_notes():
        print(f"jointrl: plan: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps({**plan.to_json(), "layouts": compare_json(layouts),
                          **({"placed": placed, "placed_env": placed_env} if placed is not None else {})}, indent=2))
    else:
        print(report(plan))
        print("\n" + compare_report(layouts))
        if placed is not None:
            print("\nplacement on Ray (GPU ids Ray gave each actor, beside the plan's):")
            for name, ids in placed.items():
                env = " ".join(f"{k}={v}" for k, v in placed_env[name].items())
                print(f"  {name}: Ray {ids}, plan {plan.actors[name].gpus}; {env}")
    return 0


def run_export(args) -> int:
    """`jointrl export`: what it wrote, a line each."""
    from driver.commands.export import export
    run = Path(args.run_dir)
    config = run_config(run, "RUN_DIR", args.overrides, layer=args.config)
    for line in export(run, Path(args.out), step=args.step, merge_lora=args.merge_lora, config=config):
        print(f"jointrl: wrote {line}")
    return 0


def run_serve_reward(args) -> int:
    from driver.commands.serve_reward import run_serve_reward as serve
    return serve(args)


def run_config_docs(args) -> int:
    """`jointrl config show|keys`: the schema's documentation; show skips the preflight checks, so a
    config that names models or files absent here can still be read."""
    from driver.config import resolve_config
    from driver.commands.config_docs import keys, show
    print(keys() if args.action == "keys" else show(resolve_config(args.config, args.overrides)))
    return 0


def run_score(args) -> int:
    from driver.commands.score import run_score as score
    return score(args)


def main(argv=None) -> int:
    """Every command; a user's error (SettingError) is one paragraph on stderr and exit status 2, a
    second signal stops at once with its status (130 for Ctrl-C). Run as the command (no `argv`),
    its status is final once said: a signal while the interpreter exits (Ray's and torch's
    teardown, about a second) is ignored rather than end the process with another status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return {"train": run_train, "pretrain": run_pretrain, "eval": evaluate, "sample": run_sample,
                "report": run_report, "config": run_config_docs, "score": run_score,
                "download": run_download, "plan": run_plan, "export": run_export,
                "serve-reward": run_serve_reward}[args.command](args)
    except SettingError as e:
        return config_error(e)
    except KeyboardInterrupt as stop:  # a second signal (StopNow) or Ctrl-C outside a run
        print("jointrl: stopped at once; the run keeps its last checkpoint", file=sys.stderr, flush=True)
        return getattr(stop, "exit_code", 130)
    finally:
        if argv is None:
            for s in EXIT_CODES:
                signal.signal(s, signal.SIG_IGN)
