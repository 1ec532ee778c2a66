"""`trainer-client`: statistics, exports and a live view of the gateway's store.

A mistake ends the command in one line, `PROG: error: WHAT`, as the gateway's command line does: exit 2 for
what the command line, the environment or the configuration file says, 1 for what the command met (no store
at the URL, a store it cannot reach, a teacher that refuses)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from datetime import datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, BinaryIO, NoReturn, TextIO

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type information (types-PyYAML is separate)
from sqlalchemy import Connection, func, select, text

DEFAULT_DB = "sqlite:///gateway.db"
_GROUPS_PER_BATCH = 100
"""Groups read (and written) at a time: exports larger than memory stream to disk."""


class _Parser(argparse.ArgumentParser):
    """Usage mistakes in one line, like the command's other errors: the usage is one --help away."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class CommandError(Exception):
    """What the command met that stops it (not a mistake of its arguments): one line, exit 1."""


def _version() -> str:
    try:
        return version("rl-gateway")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="trainer-client", description="Read training samples and statistics from the gateway's store."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    store = _store_options()
    for add in (_add_stats, _add_export, _add_score, _add_eval, _add_tail):
        command = add(commands, store)
        command.set_defaults(prog=command.prog)
    return parser


def _store_options() -> _Parser:
    """Every command reads the same store, named the same way: the arguments each inherits."""
    store = _Parser(add_help=False)
    store.add_argument(
        "--db",
        metavar="URL",
        help=f"the gateway's store, its database URL (default: $GATEWAY_DB, else the db key of the --config "
        f"file, else {DEFAULT_DB})",
    )
    store.add_argument(
        "--config",
        metavar="FILE",
        help="the gateway's configuration file (gateway serve --config), whose db key names the store "
        "[env GATEWAY_CONFIG]",
    )
    return store


def _add_stats(commands: argparse._SubParsersAction[_Parser], store: _Parser) -> _Parser:
    stats = commands.add_parser(
        "stats", parents=[store], help="rollouts, groups, turns, tokens, rewards, drift, errors, claims"
    )
    stats.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return stats


def _add_export(commands: argparse._SubParsersAction[_Parser], store: _Parser) -> _Parser:
    export = commands.add_parser(
        "export", parents=[store], help="write step-wise samples of ready groups (claims nothing)"
    )
    export.add_argument(
        "--format",
        choices=("jsonl", "parquet", "hf"),
        default="jsonl",
        help="hf: a Hugging Face `datasets` dataset, a directory `datasets.load_from_disk` reads (the hf "
        "extra)",
    )
    export.add_argument(
        "--output", "-o", required=True, help="file (hf: directory) to write; - for standard output"
    )
    _add_choice(
        export,
        "export this GRPO group only (once it is ready)",
        "export the ready groups whose rollouts were all created at or after TIME",
    )
    _add_sample_options(export)
    return export


def _add_sample_options(export: _Parser) -> None:
    """What the samples written hold and which groups give them: the export's `SampleOptions`."""
    export.add_argument(
        "--include-errors", action="store_true", help="keep rollouts with failed turns, masked"
    )
    export.add_argument("--no-std", action="store_true", help="advantages centred but not divided by the std")
    export.add_argument(
        "--merged",
        action="store_true",
        help="one sample per chain of turns that extend each other exactly (a path of the rollout's lineage "
        "tree: a sub-agent's conversation is a chain of its own)",
    )
    export.add_argument(
        "--policy",
        metavar="NAME",
        help="only the groups that train this policy (a LoRA policy's name, or a model's: rollouts.policy)",
    )
    export.add_argument(
        "--teacher",
        metavar="NAME",
        help="add this teacher's logprobs of the sampled tokens (teacher_logprobs); only groups it has "
        "scored wholly are written",
    )
    export.add_argument(
        "--group-timeout",
        type=float,
        default=None,
        help="serve a group's finished rollouts after this many seconds",
    )
    export.add_argument(
        "--current-version",
        type=int,
        metavar="N",
        help="add each sampled token's staleness against this published policy version (token_staleness: "
        "versions of its policy published after the one that sampled it)",
    )
    export.add_argument(
        "--max-token-staleness",
        type=int,
        metavar="K",
        help="with --current-version: mask the tokens staler than K out of the loss (their turns are kept)",
    )


def _add_score(commands: argparse._SubParsersAction[_Parser], store: _Parser) -> _Parser:
    score = commands.add_parser(
        "score",
        parents=[store],
        help="store a teacher vLLM's logprob of every sampled token (on-policy distillation)",
        description="Send each stored turn's exact ids (prompt and completion as the engine saw and sampled "
        "them) to a teacher vLLM server for prompt_logprobs and store the teacher's logprob of every sampled "
        "token, under the teacher's model name and weight version. Turns already scored by that teacher are "
        "left alone: rerunning resumes an interrupted run and scores only what is new. The teacher must "
        "decode every token id as the policy's server does, or it is refused.",
    )
    score.add_argument("--teacher", required=True, metavar="URL", help="the teacher's vLLM server")
    score.add_argument(
        "--model",
        required=True,
        metavar="NAME",
        help="the teacher's served model name; scores are stored under it",
    )
    _add_choice(score, "score this GRPO group's rollouts only", "score rollouts created at or after TIME")
    _add_teacher_calls(score)
    return score


def _add_teacher_calls(score: _Parser) -> None:
    """How the scoring talks to the servers: the tokenizers' check, the teacher's key and its load."""
    score.add_argument(
        "--policy",
        metavar="URL",
        help="a vLLM server of the policy, to compare tokenizers with (default: the server of the latest "
        "rollout, as the gateway recorded it)",
    )
    score.add_argument(
        "--api-key",
        default=os.environ.get("TEACHER_API_KEY"),
        help="the teacher server's --api-key (default: $TEACHER_API_KEY)",
    )
    score.add_argument(
        "--batch-tokens",
        type=_at_least_one,
        default=16384,
        help="tokens per request to the teacher (default: %(default)s)",
    )
    score.add_argument(
        "--concurrency", type=_at_least_one, default=4, help="requests in flight (default: %(default)s)"
    )


def _add_eval(commands: argparse._SubParsersAction[_Parser], store: _Parser) -> _Parser:
    evaluate = commands.add_parser(
        "eval", parents=[store], help="mean reward and pass@k of the rollouts tagged eval, per policy version"
    )
    evaluate.add_argument(
        "-k",
        type=int,
        action="append",
        dest="ks",
        metavar="K",
        help="pass@K to report (repeatable; default: 1)",
    )
    evaluate.add_argument(
        "--pass-threshold",
        type=float,
        default=1.0,
        help="a rollout passes when its reward reaches this (default: %(default)s)",
    )
    evaluate.add_argument("--output", "-o", help="also save the report as JSON to this file")
    return evaluate


def _add_tail(commands: argparse._SubParsersAction[_Parser], store: _Parser) -> _Parser:
    tail = commands.add_parser("tail", parents=[store], help="follow groups as they finish")
    tail.add_argument(
        "--interval", type=float, default=2.0, help="seconds between polls (default: %(default)s)"
    )
    tail.add_argument("--lines", type=int, default=10, help="already finished groups to show first")
    return tail


def _add_choice(parser: argparse.ArgumentParser, group_help: str, since_help: str) -> None:
    """Which rollouts a command takes, the same way for each: one group's, or those since a time."""
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--group-id", help=group_help)
    chosen.add_argument(
        "--since",
        metavar="TIME",
        type=_moment,
        help=f"{since_help}: ISO 8601 (2026-11-25T14:00:00, local time unless it says), or seconds since the "
        "epoch",
    )


def _moment(value: str) -> float:
    """Seconds since the epoch from ISO 8601 (local time unless it gives its offset) or a number."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither ISO 8601 nor seconds") from None


def _at_least_one(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def main(argv: list[str] | None = None) -> int:
    from rollout_store.database import SchemaMismatch, StoreUnreachable, reach

    args = build_parser().parse_args(argv)
    command = {"stats": _stats, "export": _export, "score": _score, "eval": _eval, "tail": _tail}[
        args.command
    ]
    args.db = _store_url(args)
    if args.command == "export":
        _check_export(args)  # what the arguments say is said before what the store says
    try:
        reach(args.db, create=False)  # a reader: a SQLite file that is not there is no store, left uncreated
        code = command(args)
        sys.stdout.flush()  # here, where a reader gone away is caught, not in the interpreter's exit
        return code
    except (CommandError, StoreUnreachable, SchemaMismatch) as exc:
        print(f"{args.prog}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _reader_left()


def _reader_left() -> int:
    """What a command does when its reader closed the pipe (`trainer-client stats | head`): it stops quietly,
    as `cat` does, with the status of a process that SIGPIPE ended; what it still holds goes nowhere."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 128 + 13


def _usage_error(args: argparse.Namespace, message: str) -> NoReturn:
    print(f"{args.prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _store_url(args: argparse.Namespace) -> str:
    """The store's URL: --db, else $GATEWAY_DB, else the configuration file's db key, else the gateway's
    default (the gateway's own order: the command line over the environment over the file)."""
    from rollout_store.database import check_url

    config = args.config or os.environ.get("GATEWAY_CONFIG") or None
    configured = _configured_db(args, config) if config else None
    for url, where in (
        (args.db, "--db"),
        (os.environ.get("GATEWAY_DB") or None, "GATEWAY_DB"),
        (configured, f"{config}: db"),
    ):
        if url is not None:
            try:
                return check_url(url)
            except ValueError as exc:
                _usage_error(args, f"{where}: {exc}")
    return DEFAULT_DB


def _configured_db(args: argparse.Namespace, path: str) -> str | None:
    """The db key of the gateway's configuration file (the gateway checks its other keys)."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        _usage_error(args, f"{path}: no such file")
    except (OSError, UnicodeDecodeError) as exc:
        _usage_error(args, f"{path}: cannot be read: {exc}")
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        _usage_error(args, f"{path}: {where}not YAML: {getattr(exc, 'problem', None) or exc}")
    if data is None:
        return None
    if not isinstance(data, dict):
        _usage_error(args, f"{path}: not a mapping of settings (`name: value` lines)")
    db = data.get("db")
    if db is not None and not isinstance(db, str):
        _usage_error(args, f"{path}: db: not a database URL")
    return db


def _stats(args: argparse.Namespace) -> int:
    from rollout_store.database import make_engine, require_current_schema
    from trainer_client.stats import collect

    engine = make_engine(args.db)
    require_current_schema(engine)
    with engine.connect() as conn:
        report = collect(conn)
    engine.dispose()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    for name, rows in report.items():
        print(f"\n{name.replace('_', ' ')}")
        _table(rows)
    return 0


def _table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("  (none)")
        return
    columns = list(rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for row in cells:
        print("  " + "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _export(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trainer_client.client import TrainerClient
    from training_data.groups import SampleOptions, ready_groups

    options = SampleOptions(
        group_timeout=args.group_timeout,
        include_errors=args.include_errors,
        normalize_std=not args.no_std,
        merged=args.merged,
        teacher=args.teacher,
        policy=args.policy,
        current_version=args.current_version,
        max_token_staleness=args.max_token_staleness,
    )
    to_stdout = args.output == "-"
    if args.format == "hf":
        return _export_hf(args, options)
    target: Any = sys.stdout.buffer if to_stdout else Path(args.output)
    sink = _JsonlSink(target) if args.format == "jsonl" else _ParquetSink(target)
    written = 0
    with TrainerClient(args.db) as client:
        with client.engine.connect() as conn:
            groups = _chosen(
                conn, ready_groups(conn, options, unclaimed_only=False), args.group_id, args.since
            )
        shown = sys.stderr if sys.stderr.isatty() else _LastDrawing(sys.stderr)
        with tqdm(total=len(groups), unit="group", desc="exporting", file=shown) as progress:
            for start in range(0, len(groups), _GROUPS_PER_BATCH):
                batch = client.read_groups(groups[start : start + _GROUPS_PER_BATCH], options)
                sink.write([sample.to_json() for sample in batch.samples])
                written += len(batch.samples)
                progress.update(batch.counts.get("groups", 0) + batch.counts.get("dropped_groups", 0))
    sink.close()
    print(f"wrote {written} samples to {'standard output' if to_stdout else args.output}", file=sys.stderr)
    return 0


def _chosen(conn: Connection, ready: list[str], group_id: str | None, since: float | None) -> list[str]:
    """The ready groups --group-id or --since choose (all without either), oldest first."""
    from rollout_store import schema

    if group_id is not None:
        return [group for group in ready if group == group_id]
    if since is None:
        return ready
    r = schema.rollouts
    started = select(r.c.group_id).group_by(r.c.group_id).having(func.min(r.c.created_at) >= since)
    later = {row[0] for row in conn.execute(started)}
    return [group for group in ready if group in later]


def _check_export(args: argparse.Namespace) -> None:
    if args.max_token_staleness is not None and args.current_version is None:
        _usage_error(args, "--max-token-staleness needs --current-version")
    if args.format == "parquet" and args.output == "-" and sys.stdout.isatty():
        _usage_error(args, "refusing to write parquet to a terminal; redirect it or use -o FILE")
    if args.format != "hf":
        return
    if args.output == "-":
        _usage_error(args, "--format hf writes a directory: give it with -o DIR")
    if args.group_id is not None or args.since is not None:
        _usage_error(
            args, "--format hf writes every ready group: --group-id and --since take jsonl or parquet"
        )
    if importlib.util.find_spec("datasets") is None:
        _usage_error(args, "--format hf needs the hf extra: pip install 'rl-gateway[hf]'")


def _export_hf(args: argparse.Namespace, options: Any) -> int:
    from trainer_client import hf

    written = hf.save(args.db, options, Path(args.output))
    print(f"wrote {written} samples to {args.output}", file=sys.stderr)
    return 0


class _LastDrawing:
    """Where the progress bar draws when stderr is no terminal. The bar draws itself on start, as it
    advances and when done, each drawing after a carriage return that only a terminal draws over: a log, a
    pipe read as text, kept them all (at least twice: 0% and 100%). This keeps only the latest drawing and
    writes it when the bar ends its line."""

    def __init__(self, target: TextIO) -> None:
        self._target = target
        self._drawing = ""
        self.encoding = target.encoding
        """What tqdm reads to choose between block characters and ASCII."""

    def write(self, text: str) -> int:
        self._drawing = (self._drawing + text).rsplit("\r", 1)[-1]
        if self._drawing.endswith("\n"):
            self._target.write(self._drawing.rstrip("\n ") + "\n")  # less the blanks that erase a longer one
            self._target.flush()
            self._drawing = ""
        return len(text)

    def flush(self) -> None:
        """Nothing to do: the drawing is written when it is final."""


class _JsonlSink:
    def __init__(self, target: Path | BinaryIO) -> None:
        self._owned = isinstance(target, Path)
        # The sink owns the file it opened and closes it in close().
        self._file: BinaryIO = open(target, "wb") if isinstance(target, Path) else target  # noqa: SIM115

    def write(self, records: list[dict[str, Any]]) -> None:
        self._file.writelines(json.dumps(record).encode() + b"\n" for record in records)

    def close(self) -> None:
        if self._owned:
            self._file.close()
        else:
            self._file.flush()


class _ParquetSink:
    """One row group per batch, so that exports larger than memory stream to disk."""

    def __init__(self, target: Path | BinaryIO) -> None:
        self._target = target
        self._writer: Any = None

    def write(self, records: list[dict[str, Any]]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if not records:
            return
        for record in records:
            record["reward_components"] = json.dumps(record["reward_components"])
        table = pa.Table.from_pylist(records)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self._target, table.schema)
        self._writer.write_table(table.cast(self._writer.schema))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _score(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from trainer_client.scoring import Scorer, TeacherError, TeacherServer
    from training_data.teacher_scores import ScoreFilter

    teacher = TeacherServer(args.teacher, args.model, api_key=args.api_key)
    scorer = Scorer(args.db, teacher, batch_tokens=args.batch_tokens, concurrency=args.concurrency)
    shown = sys.stderr if sys.stderr.isatty() else _LastDrawing(sys.stderr)
    bars: list[tqdm[None]] = []  # drawn from the first report of work to do

    def advance(done: int, total: int) -> None:
        if not bars and total:
            bars.append(tqdm(total=total, unit="turn", desc="scoring", file=shown))
        if bars:
            bars[0].update(done - bars[0].n)

    try:
        scorer.check(args.policy)
        report = scorer.score(ScoreFilter(group_id=args.group_id, since=args.since), advance)
    except TeacherError as exc:
        raise CommandError(str(exc)) from None
    finally:
        for bar in bars:
            bar.close()
        scorer.close()
        teacher.close()
    print(
        f"scored {report.turns} turns ({report.tokens:,} sampled tokens) in {report.requests} requests: "
        f"{report.sequence_tokens:,} tokens to the teacher in {report.seconds:.1f} s "
        f"({report.tokens_per_s:,.0f} tokens/s)",
        file=sys.stderr,
    )
    if report.too_long:
        print(
            f"left {len(report.too_long)} turns unscored: longer than the teacher's context "
            f"(first: rollout {report.too_long[0][0]} turn {report.too_long[0][1]})",
            file=sys.stderr,
        )
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rollout_store.database import make_engine, require_current_schema
    from training_data.evaluation import evaluation_report

    engine = make_engine(args.db)
    require_current_schema(engine)
    with engine.connect() as conn:
        report = evaluation_report(conn, tuple(args.ks or (1,)), args.pass_threshold)
    engine.dispose()
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(f"evaluation rollouts per policy version (pass: reward >= {args.pass_threshold})")
    _table(report["policy_versions"])
    if args.output:
        print(f"saved to {args.output}")
    return 0


def _tail(args: argparse.Namespace) -> int:
    from rollout_store.database import make_engine, require_current_schema
    from trainer_client.stats import COMPLETE_GROUP

    engine = make_engine(args.db)
    require_current_schema(engine)
    query = text(
        "SELECT group_id, rollouts, reward_mean, reward_std, last_finished_at FROM group_stats "
        f"WHERE {COMPLETE_GROUP} AND last_finished_at > :since ORDER BY last_finished_at, group_id"
    )
    print(
        f"{'finished at':<20} {'group':<36} {'rollouts':>8} {'reward mean':>12} {'reward std':>11}",
        flush=True,
    )
    try:
        with engine.connect() as conn:
            rows = conn.execute(query, {"since": 0.0}).all()
        since = max((row.last_finished_at for row in rows), default=0.0)
        rows = rows[-args.lines :] if args.lines > 0 else []
        while True:
            for group_id, rollouts, mean, std, finished_at in rows:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(finished_at))
                print(
                    f"{stamp:<20} {group_id:<36} {rollouts:>8} {_cell(mean):>12} {_cell(std):>11}", flush=True
                )
                since = max(since, finished_at)
            time.sleep(args.interval)
            with engine.connect() as conn:
                rows = conn.execute(query, {"since": since}).all()
    except KeyboardInterrupt:
        return 0
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
