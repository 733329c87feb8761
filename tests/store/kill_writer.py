"""Writer process for the SIGKILL test: puts runs forever, printing each
acknowledged put (and delete) on stdout, flushed, before starting the next."""

import sys

from kvblock import KVStore
from tests.store.workload import run_data, run_keys

path, start = sys.argv[1], int(sys.argv[2])
store = KVStore.open([path])
i = start
while True:
    keys = run_keys(i, 1 + i % 4)
    store.put_run(keys, run_data(keys))
    print(f"put {i}", flush=True)
    if i % 7 == 6:
        store.delete(run_keys(i - 3, 1 + (i - 3) % 4)[:1])
        print(f"del {i - 3}", flush=True)
    i += 1
