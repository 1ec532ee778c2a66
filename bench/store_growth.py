"""What a model call costs as the store grows: the gateway's latency and throughput (as
bench/gateway_overhead.py measures them) on a store already holding 0, 100k and 1M turns.

    python bench/store_growth.py [--sizes 0,100000,1000000] [--stores sqlite,postgresql] [--load wrk]

The store is filled as the gateway fills it: its first turns are the gateway's own (rollouts of 20 calls
against bench/fake_vllm.py, 3.2k prompt ids a turn), then copied under new rollout ids, doubling until the
store holds the size asked for, and finished (on PostgreSQL the copies load as a restore does, without the
per-row checks, and the tables are vacuumed and analysed after). Then a gateway starts on each store in turn,
`--rounds` times, and is measured: its new rollouts land beside the stored ones, in the same tables and
indexes. Each size's medians are printed with their ratio to the first size's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fake_vllm
import sqlalchemy as sa
from gateway_overhead import Client, agent_body, load_arguments, measure, paths_for, postgres_schemas

from rollout_store.database import ensure_schema, make_engine
from rollout_store.schema import rollouts, turns
from testbed.launcher import GatewayProcess

SEED_TURNS = 200
"""Turns the gateway records itself before the store is doubled up to size."""


async def record(port: int, calls: int) -> None:
    """`calls` turns through the gateway, in rollouts of 20."""
    client, body, paths = Client("127.0.0.1", port), agent_body(), paths_for("gateway")
    await client.connect()
    for _ in range(calls):
        if await client.post(next(paths), body) != 200:
            raise RuntimeError("the seed call failed")
    client.writer.close()


def double(db_url: str, size: int) -> None:
    """Copy the store's rollouts and turns under new ids until it holds `size` turns (each copy's turns are
    whole rollouts: the count ends at or just past `size`), every copied rollout finished."""
    engine = make_engine(db_url)
    rollout_columns = [c.name for c in rollouts.columns]
    turn_columns = [c.name for c in turns.columns if c.name != "turn_id"]
    generation = 0
    while True:
        with engine.connect() as conn:
            held = conn.execute(sa.text("SELECT COUNT(*) FROM turns")).scalar_one()
        print(f"  {held:>9,} turns stored", flush=True)
        if held >= size:
            break
        generation += 1
        per_rollout = held // max(1, _count(engine, "rollouts"))
        wanted = max(1, (size - held) // max(1, per_rollout))
        with engine.begin() as conn:
            copy = f"'-{generation}'"
            conn.execute(
                sa.text(f"CREATE TEMPORARY TABLE picked AS SELECT rollout_id FROM rollouts LIMIT {wanted}")
            )
            if engine.dialect.name == "postgresql":  # copies, as a restore loads them: no row checked again
                conn.execute(sa.text("SET LOCAL session_replication_role = replica"))
            renamed = {"rollout_id": f"rollout_id || {copy}", "group_id": f"group_id || {copy}"}
            for table, columns in (("rollouts", rollout_columns), ("turns", turn_columns)):
                conn.execute(
                    sa.text(
                        f"INSERT INTO {table} ({', '.join(columns)}) SELECT "
                        + ", ".join(renamed.get(c, c) for c in columns)
                        + f" FROM {table} WHERE rollout_id IN (SELECT rollout_id FROM picked)"
                    )
                )
            conn.execute(sa.text("DROP TABLE picked"))
    with engine.begin() as conn:  # a turn is stored only on a running rollout: the copies finish last
        conn.execute(sa.text("UPDATE rollouts SET status = 'finished', finished_at = created_at + 1"))
    if engine.dialect.name == "postgresql":  # as autovacuum leaves a store that grew over weeks
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM (ANALYZE) rollouts, turns"))
    engine.dispose()


def _count(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def filled(store: str, size: int, backend: list[str], work: Path, schema: str) -> str:
    """A store of `store`'s kind holding `size` turns."""
    db_url = f"sqlite:///{work / f'growth-{size}.db'}" if store == "sqlite" else schema
    ensure_schema(db_url)
    if size:
        started = time.perf_counter()
        with GatewayProcess(backend, db_url, log_path=work / "seed.log") as gw:
            asyncio.run(record(gw.port, min(size, SEED_TURNS)))
        double(db_url, size)
        print(f"  {store}: {size:,} turns stored in {time.perf_counter() - started:.0f} s", flush=True)
    return db_url


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0,100000,1000000", help="stored turns before each measure")
    parser.add_argument("--stores", default="sqlite,postgresql", help="the stores measured")
    parser.add_argument("--rounds", type=int, default=3, help="runs at each size, the sizes in turn")
    load_arguments(parser)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    work = Path(tempfile.mkdtemp(prefix="gateway-growth-"))
    upstream, upstream_port = fake_vllm.start(work)
    backend = [f"http://127.0.0.1:{upstream_port}"]
    try:
        with postgres_schemas(len(sizes)) as schemas:
            for store in args.stores.split(","):
                urls = [
                    filled(store, size, backend, work, schema)
                    for size, schema in zip(sizes, schemas, strict=True)
                ]
                runs: dict[int, list[tuple[float, float, float]]] = {size: [] for size in sizes}
                for round_ in range(args.rounds):
                    for size, db_url in zip(sizes, urls, strict=True):
                        with GatewayProcess(backend, db_url, log_path=work / "gateway.log") as gw:
                            runs[size].append(measure(gw.port, "gateway", args))
                        p50, _, rate = runs[size][-1]
                        print(
                            f"  {store} {size:>10,} run {round_ + 1}: p50 {p50:.2f} ms, {rate:.0f} req/s",
                            flush=True,
                        )
                report(store, runs)
                for db_url in urls:
                    if store == "sqlite":
                        Path(db_url.removeprefix("sqlite:///")).unlink()
    finally:
        upstream.stop()
    return 0


def report(store: str, runs: dict[int, list[tuple[float, float, float]]]) -> None:
    """Each size's medians, and their ratio to the first size's."""
    print(
        f"{'store':<12} {'turns':>10} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} "
        f"{'p50 vs first':>13} {'req/s vs first':>15}"
    )
    first = None
    for size, rows in runs.items():
        p50, p99, rate = (statistics.median(column) for column in zip(*rows, strict=True))
        first = first or (p50, rate)
        print(
            f"{store:<12} {size:>10,} {p50:>8.2f} {p99:>8.2f} {rate:>8.0f} {p50 / first[0]:>12.1%} "
            f"{rate / first[1]:>14.1%}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
