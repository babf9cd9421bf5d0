"""The ``reef`` command.

Exit codes: 0 success, 2 bad config or usage, 1 runtime failure (a busy port or data directory: refused before
the model loads), 3 ``reef serve``'s start-up failed after loading
(uvicorn's STARTUP_FAILURE: the app's lifespan start-up raised, or the port could not be bound), 141 stdout closed
early (``reef config | head``: 128 + SIGPIPE, what a shell reports for any program whose reader left; no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from . import __version__
from .errors import ConfigError, ReefError

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: stdout's reader closed it before the output was written


class _ServeHelp(argparse.Action):
    """``reef serve --help``: the usage, then the config's sections and groups (:mod:`reef_core.config.help`),
    generated only when asked (it composes the default config and reads every recipe package's search path)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from .config.help import serve_epilog

        try:
            parser.epilog = serve_epilog()
        except ReefError as exc:  # a broken recipe package: the usage still prints, and says why the rest did not
            parser.epilog = f"(the config could not be listed: {exc.message})"
        parser.print_help()
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reef",
        description="Reef: serve agents, record every interaction, learn from feedback, publish gated releases.",
    )
    parser.add_argument("--version", "-V", action="version", version=f"reef {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="start the HTTP server (e.g. reef serve +recipe=sao server.port=8900)",
                       add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action=_ServeHelp, help="show this help, the config sections' most-used keys "
                                                           "with their defaults, and the config groups; exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (SECTION.KEY=VALUE, +GROUP=OPTION)")

    p = sub.add_parser("learn", help="run the learners only, beside serving replicas (server.learner=false) that "
                                     "share its PostgreSQL record store and artifact repository")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (the replicas' config)")

    p = sub.add_parser("config", help="print the resolved config, secrets redacted (routed recipes' own sections "
                                      "under routed_recipes)")
    p.add_argument("overrides", nargs="*")

    p = sub.add_parser("plugins", help="list loaded plugins, their hooks and components")
    p.add_argument("--all", action="store_true", help="include Reef's built-in plugins")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("recipes", help="list installed recipes")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("sweep", help="Hydra multirun of offline tasks (reef sweep -m +recipe=sao,gepa seed=0,1)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="Hydra arguments, e.g. -m and overrides")

    p = sub.add_parser("gc", help="apply the artifact retention policy (--records: the record retention)")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--records", action="store_true",
                   help="compact record bodies under storage.retention (max_age, max_bytes, keep_scored)")
    p.add_argument("--scenario", default=None, help="with --records: only this scenario")
    p.add_argument("overrides", nargs="*")

    p = sub.add_parser("eval", help="evaluate without recording (reef eval releases --scenario S --tasks FILE)")
    kinds = p.add_subparsers(dest="eval_command", metavar="WHAT", required=True)
    e = kinds.add_parser("releases", help="score every retained release of a scenario on held-out task files, "
                                          "through a private engine; records, trains and publishes nothing")
    e.add_argument("--scenario", required=True, help="the scenario whose release chain to evaluate")
    e.add_argument("--tasks", action="append", required=True, metavar="[SET=]FILE",
                   help="a JSONL task file (the learn.file format; pkg://<package>/<path> allowed), scored by "
                        "learn.verifier; repeat for several task sets (a task's own 'set' field also names one)")
    e.add_argument("--from", dest="first", metavar="RELEASE", help="the oldest release to evaluate (an id or a "
                                                                   "unique prefix of 7+ digits)")
    e.add_argument("--to", dest="last", metavar="RELEASE", help="the newest release to evaluate")
    e.add_argument("--last", dest="last_n", type=int, metavar="N", help="only the newest N retained releases")
    e.add_argument("--max-tokens", type=int, metavar="N", help="each reply's budget (default: "
                                                              "evaluation.options.generation, learn.max_tokens, "
                                                              "engine.max_new_tokens)")
    e.add_argument("--no-save", action="store_true", help="print the result only (default: also keep it under "
                                                          "<data_dir>/evaluations/ for the dashboard)")
    e.add_argument("overrides", nargs="*", help="Hydra overrides: the scenario's deployment (+recipe=..., "
                                                "storage.data_dir=..., engine.model=...)")

    p = sub.add_parser("export", help="write a scenario's records as a dataset (OpenAI fine-tuning JSONL, Reef's "
                                      "import envelopes, a Hugging Face dataset or Parquet)")
    p.add_argument("--scenario", required=True, help="the scenario whose records to export")
    p.add_argument("--format", dest="export_format", default="openai-jsonl", metavar="FORMAT",
                   help="openai-jsonl (default), reef-jsonl (imports back with the same content hashes), hf or "
                        "parquet (these two need reef-core[export])")
    p.add_argument("--since", metavar="TIME|SEQUENCE", help="records created from an ISO-8601 time on, or after a "
                                                            "record sequence")
    p.add_argument("--release", metavar="ID", help="only records this release served (an id or a unique prefix "
                                                   "of 7+ hex digits)")
    p.add_argument("--scored-only", action="store_true", help="only records a report gave a score")
    p.add_argument("--out", metavar="PATH", help="the file (hf: the directory) to write; default stdout "
                                                 "(JSONL formats only)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides: the deployment (storage.data_dir=..., "
                                                "storage.records_url=...)")

    # Commands that talk to a running server (reef report, records, releases, status, harness pull).
    from .client.cli import add_commands

    COMMANDS.update(add_commands(sub))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a ``reef`` command; returns its exit code (see the module docstring)."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # a buffered pipe fails here, not at interpreter exit ("Exception ignored ...")
        return code
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        return EXIT_BROKEN_PIPE


def _stdout_closed() -> bool:
    """Whether stdout's reader left (its pipe polls as an error); if so point stdout at devnull so that the exit's
    flush writes nothing (https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    try:
        import select

        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        events = poller.poll(0)
        if not any(mask & select.POLLERR for _, mask in events):
            return False  # stdout is still read: the broken pipe was something else's
    except (AttributeError, OSError):  # pragma: no cover - no poll(): take the broken pipe as stdout's
        pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return True


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] == "sweep":
        # Hydra parses sweep arguments itself (-m, --cfg, --help, overrides).
        from .sweep import run_sweep

        return run_sweep(argv[1:])
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help/--version
        return int(exc.code or 0)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"reef: error: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except ReefError as exc:
        print(f"reef: error: {exc.message}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        return EXIT_RUNTIME


def cmd_serve(args) -> int:
    import gc

    # Start-up allocates millions of objects (imports, config, model) and leaves few cycles: the collector's passes
    # over them took ~15% of start-up's CPU (issue #41). It is enabled again once start-up is done
    # (serve.process.server.freeze_startup_objects).
    gc.disable()
    from .config.apart import compose_apart

    # Composed in a child process that exits (Hydra and OmegaConf never load here), while this one imports the
    # server's modules and loads the plugins on the other core.
    cfg = compose_apart(args.overrides, meanwhile=_load_server_modules)
    if cfg.server.learner:
        _check_data_dir_free(cfg)
    from .serve.process.server import serve

    return serve(cfg)


def _load_server_modules() -> None:
    """What ``reef serve`` loads whatever the config says: the app's modules and the plugins."""
    import importlib

    for module in ("reef_core.serve.process.server", "reef_core.loop.assemble", "reef_core.serve.app"):
        importlib.import_module(module)
    from .plugins import get_plugin_manager

    get_plugin_manager()


def _check_data_dir_free(cfg) -> None:
    """A second server on a data directory another one writes: one line (LogLocked, exit 1) before the model
    loads, not the lifespan traceback and uvicorn's exit 3. The server still takes the lock itself; this only
    asks early (two started at the same instant may still meet there)."""
    from pathlib import Path

    from .commit.commitlog import WriterLock

    commits = Path(cfg.storage.data_dir) / "commits"
    if commits.is_dir():  # no directory yet: no other writer, and a refused start must create nothing
        WriterLock(commits).release()


def cmd_learn(args) -> int:
    from .config import compose_config
    from .loop.learn_command import run_learn

    return run_learn(compose_config(args.overrides))


def cmd_config(args) -> int:
    from .config import as_yaml, compose_config, redacted
    from .config.recipes import recipe_bindings

    cfg = compose_config(args.overrides)
    data = redacted(cfg)
    # A routed recipe runs with its own composition, not the top-level sections above: show what it runs with.
    routed = {name: binding.sections() for name, binding in recipe_bindings(cfg).items() if not binding.default}
    if routed:
        data["routed_recipes"] = redacted(routed)
    print(as_yaml(data), end="")
    return EXIT_OK


def cmd_plugins(args) -> int:
    from .plugins import get_plugin_manager

    pm = get_plugin_manager()
    rows = []
    for info in pm.info.values():
        if info.builtin and not args.all:
            continue
        components = {
            kind: sorted(name for name, c in by_name.items() if c.plugin == info.name)
            for kind, by_name in pm.components.items()
        }
        rows.append({
            "name": info.name, "version": info.version, "module": info.module, "builtin": info.builtin,
            "hooks": info.hooks, "components": {k: v for k, v in components.items() if v},
        })
    failed = [{"name": name, "error": error} for name, error in sorted(pm.failures.items())]
    if args.json:
        print(json.dumps({"plugins": rows, "failed": failed}, indent=2))
        return EXIT_OK
    for row in rows:
        print(f"{row['name']} {row['version'] or ''}".rstrip())
        print(f"  hooks: {', '.join(row['hooks'])}")
        for kind, names in row["components"].items():
            print(f"  {kind}: {', '.join(names)}")
    for row in failed:
        print(f"{row['name']} FAILED")
        print("  " + row["error"].replace("\n", "\n  "))
    if not rows and not failed:
        print("no plugins installed (reef plugins --all shows the built-ins)")
    return EXIT_OK


def cmd_recipes(args) -> int:
    from .config import recipe_descriptions

    recipes = recipe_descriptions()
    if args.json:
        print(json.dumps(recipes, indent=2))
    elif not recipes:
        print("no recipes installed; install one, e.g. pip install reef-sao")
    else:
        width = max(len(name) for name in recipes)
        for name, description in recipes.items():
            print(f"{name.ljust(width)}  {description}")
    return EXIT_OK


def cmd_sweep(args) -> int:
    from .sweep import run_sweep

    return run_sweep(args.args)


def cmd_gc(args) -> int:
    from .commit.gc_command import run_gc_command

    from .config import compose_config

    if args.scenario is not None and not args.records:
        raise ConfigError("--scenario applies to reef gc --records only", flag="--scenario")
    cfg = compose_config(args.overrides)
    if args.records:
        from .loop.records_gc import run_records_gc_command

        return run_records_gc_command(cfg, dry_run=args.dry_run, scenario=args.scenario)
    return run_gc_command(cfg, dry_run=args.dry_run)


def cmd_eval(args) -> int:
    from .config import compose_config
    from .loop.eval_command import run_eval_releases

    cfg = compose_config(args.overrides)
    return run_eval_releases(cfg, scenario=args.scenario, tasks=args.tasks, first=args.first, last=args.last,
                             last_n=args.last_n, max_tokens=args.max_tokens, save=not args.no_save)


def cmd_export(args) -> int:
    from .loop.export_command import check_flags, run_export

    check_flags(args.export_format, args.since, args.out)  # before the config is composed
    from .config import compose_config

    cfg = compose_config(args.overrides)
    return run_export(cfg, scenario=args.scenario, fmt=args.export_format, since=args.since, release=args.release,
                      scored_only=args.scored_only, out=args.out)


COMMANDS = {
    "serve": cmd_serve, "learn": cmd_learn, "config": cmd_config, "plugins": cmd_plugins, "recipes": cmd_recipes,
    "sweep": cmd_sweep, "gc": cmd_gc, "eval": cmd_eval, "export": cmd_export,
}

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
