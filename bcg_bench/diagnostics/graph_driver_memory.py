"""Diagnostic: the device memory the driver takes per captured CUDA graph, by kernel count.

Run from the repository root on a CUDA machine: ``python3 -m bcg_bench.diagnostics.graph_driver_memory``.
bcg's graph memory has a part no allocator holds, the driver's memory for the instantiated graphs,
which grows with buckets x segments (0.22 GiB for 56 x 29 segments). This captures ``GRAPHS`` graphs
of K kernels each, K in ``KERNELS``, for two kinds of kernel: an in-place elementwise add, and a
small matmul written into a preallocated output (cuBLAS, the kind most of a segment's nodes are).
Every capture shares one pool and allocates nothing in it (in-place or ``out=`` ops; the cuBLAS
workspace of the capture stream is taken before), so the free-memory drop across the captures,
read after ``empty_cache``, is what the driver had to add for them. Prints KiB per graph for each K
and the fitted cost of a graph and of one kernel node in it.

The driver keeps the memory of released graphs and gives it to later ones in the process, so each
row reads only what the rows before it did not leave behind. By default a first round (1000 graphs
of 64 matmuls, captured and released, not printed) comes first: the rows then read what the driver
adds beyond it (on an H200: nothing for matmul graphs). ``--graphs 200 --no-first-round``,
as first run, reads the growth in a fresh process instead: about 2 KiB per kernel node, with the
first row carrying the driver's one-time set-up.
"""
import argparse

import torch

GRAPHS = 1000  # the driver takes device memory in 2 MiB steps: ~2 KiB per graph of resolution
KERNELS = (1, 4, 16, 64)
KiB = 1024


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def per_graph_bytes(kind: str, k: int, stream: torch.cuda.Stream, graphs: int = GRAPHS) -> float:
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 64, device="cuda", dtype=torch.bfloat16)

    def body():
        for _ in range(k):
            if kind == "add":
                a.add_(1)
            else:
                torch.mm(a, b, out=out)

    with torch.cuda.stream(stream):
        body()  # the stream's cuBLAS workspace and any lazy kernel loading happen here, outside the graphs
    pool = torch.cuda.graph_pool_handle()
    captured = []
    before = free_bytes()
    for _ in range(graphs):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            body()
        captured.append(g)
    after = free_bytes()
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot(pool, include_traces=False))
    for g in captured:
        g.replay()
    torch.cuda.synchronize()
    for g in captured:
        g.reset()
    return (before - after - pool_bytes) / graphs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=int, default=GRAPHS, help="graphs captured per row")
    ap.add_argument("--no-first-round", action="store_true", help="measure from a fresh process's state")
    a = ap.parse_args()
    stream = torch.cuda.Stream()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, driver memory per graph, "
          f"{a.graphs} graphs per row")
    print("| kernel | kernels per graph | KiB per graph |")
    print("|---|---|---|")
    if not a.no_first_round:
        per_graph_bytes("mm", KERNELS[-1], stream)  # released at once: memory the driver then keeps
    for kind in ("add", "mm"):
        rows = []
        for k in KERNELS:
            rows.append((k, per_graph_bytes(kind, k, stream, a.graphs)))
            print(f"| {kind} | {k} | {rows[-1][1] / KiB:.1f} |", flush=True)
        ks = [k for k, _ in rows]
        ys = [y for _, y in rows]
        mk, my = sum(ks) / len(ks), sum(ys) / len(ys)
        slope = sum((k - mk) * (y - my) for k, y in rows) / sum((k - mk) ** 2 for k in ks)
        print(f"{kind}: fitted {(my - slope * mk) / KiB:.1f} KiB per graph + {slope / KiB:.2f} KiB per kernel node")


if __name__ == "__main__":
    main()
