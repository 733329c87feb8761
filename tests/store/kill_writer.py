"""Writer process for the SIGKILL test: puts runs forever, sending each
acknowledged put (and delete) to the test before starting the next.  With
``how="put_runs"`` the runs go three at a time through put_runs, from aligned
buffers (so that some are written in one engine call).

The test forks writers from a forkserver that has imported this module (and
kvblock with it), so a round does not pay for a Python start and the imports."""

from kvblock import KVStore, aligned_empty
from tests.store.workload import run_data, run_keys


def write_until_killed(path: str, start: int, how: str, conn) -> None:
    """``conn``: the write end of a multiprocessing pipe.  Each line is one
    message, sent in one write(2) (a pipe takes it whole), so a kill never
    leaves half of one."""
    group = 3 if how == "put_runs" else 1
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
        conn.send_bytes(f"put {' '.join(map(str, range(i, i + group)))}".encode())
        for j in range(i, i + group):
            if j % 7 == 6:
                store.delete(run_keys(j - 3, 1 + (j - 3) % 4)[:1])
                conn.send_bytes(f"del {j - 3}".encode())
        i += group
