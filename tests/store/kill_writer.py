"""Writer process for the SIGKILL test: puts runs forever, writing each
acknowledged put (and delete) to stdout before starting the next.
With a third argument ``put_runs`` the runs go three at a time through
put_runs, from aligned buffers (so that some are written in one engine call)."""

import os
import sys

from kvblock import KVStore, aligned_empty
from tests.store.workload import run_data, run_keys


def say(line: str) -> None:
    """One line in one write(2) (a pipe takes it whole), so a kill never
    leaves half of it: print() may write a line in pieces."""
    os.write(1, (line + "\n").encode())


path, start = sys.argv[1], int(sys.argv[2])
group = 3 if sys.argv[3:] == ["put_runs"] else 1
store = KVStore.open([path])
i = start
while True:
    todo = [run_keys(j, 1 + j % 4) for j in range(i, i + group)]
    if group == 1:
        store.put_run(todo[0], run_data(todo[0]))
    else:
        runs = []
        for keys in todo:
            data = aligned_empty(len(keys) * run_data(keys[:1]).size)
            data[:] = run_data(keys)
            runs.append((keys, data))
        store.put_runs(runs)
    say(f"put {' '.join(map(str, range(i, i + group)))}")
    for j in range(i, i + group):
        if j % 7 == 6:
            store.delete(run_keys(j - 3, 1 + (j - 3) % 4)[:1])
            say(f"del {j - 3}")
    i += group
