"""The layer table at a wide shape: pages read from the stored key orders, and by the database's sort.

Two layers of a shape's width (default Llama-3.3-70B's 28,672 keys) written by bench.synthetic_index's
`write_run`, then `layer_table.layer_keys` for every sort, PAGES pages each at random among the first, the
second, one in the middle and the last, both directions: p50 ms with the stored orders (`key_orders`),
then the same database with them deleted, so the database sorts the rows (how a run stored before
revision 0031 is read). Figures go into bench-results.json under "layer-orders-<db>".

    python -m bench.layer_orders --backend sqlite [--shape llama-3.3-70b] [--no-record]
"""

from __future__ import annotations

import random
import statistics
import time

from sqlalchemy import delete
from sqlalchemy.orm import Session

from bench import harness, scale
from bench.synthetic_index import Shape, write_run
from ffmem.store import layer_table
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.store.models import KeyOrder

PAGES = 15  # per sort and way of reading


def page_times(session: Session, run_id: int, n_keys: int) -> dict[str, float]:
    """Sort → p50 ms of a page of 50 keys of layer 1."""
    pick, found = random.Random(0), {}
    last = (n_keys - 1) // 50
    for sort in layer_table.KEY_SORTS:
        ms = []
        for _ in range(PAGES):
            page = pick.choice([0, 1, last // 2, last])
            start = time.perf_counter()
            layer_table.layer_keys(
                session=session, run_id=run_id, layer=1, sort=sort, descending=pick.random() < 0.5,
                offset=page * 50, limit=50,
            )  # fmt: skip
            ms.append(1000 * (time.perf_counter() - start))
        found[sort] = round(statistics.median(ms), 1)
    return found


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--shape", choices=sorted(scale.SHAPES), default="llama-3.3-70b")
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    args = parser.parse_args()
    shape = Shape(
        **{**scale.SHAPES[args.shape], "n_layers": 2, "slug": f"orders-{args.shape}"}, token_memories=0
    )
    url = scale.database(args.backend, shape)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        run_id = write_run(session, shape).run_id
    scale.analyze(url)
    with make_sessionmaker(engine)() as session:
        stored = page_times(session, run_id, shape.n_keys)
        session.execute(delete(KeyOrder))
        session.commit()
        sorted_rows = page_times(session, run_id, shape.n_keys)
    engine.dispose()
    for sort in layer_table.KEY_SORTS:
        print(
            f"{sort:<20} stored order p50 {stored[sort]:7.1f} ms   "
            f"sort of the rows p50 {sorted_rows[sort]:7.1f} ms"
        )
    results = {
        "shape": args.shape,
        "n_keys": shape.n_keys,
        "stored_order_p50_ms": stored,
        "sorted_rows_p50_ms": sorted_rows,
    }
    harness.record(args, f"layer-orders-{args.backend}", results)


if __name__ == "__main__":
    main()
