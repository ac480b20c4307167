"""Diagnostic: the device memory the driver takes per captured CUDA graph, by kernel count.

Run from the repository root on a CUDA machine: ``python3 benchmarks/diagnostics/graph_driver_memory.py``.
bcg's graph memory has a part no allocator holds, the driver's memory for the instantiated graphs,
which grows with buckets x segments (0.22 GiB for 56 x 29 segments). This captures ``GRAPHS`` graphs
of K kernels each, K in ``KERNELS``, for two kinds of kernel: an in-place elementwise add, and a
small matmul written into a preallocated output (cuBLAS, the kind most of a segment's nodes are).
Every capture shares one pool and allocates nothing in it (in-place or ``out=`` ops; the cuBLAS
workspace of the capture stream is taken before), so the free-memory drop across the captures,
read after ``empty_cache``, is the driver's. A first round, not printed, takes what the driver
sets up once per process. Prints KiB per graph for each K and the fitted cost of a graph and of one
kernel node in it.
"""
import torch

GRAPHS = 1000  # the driver takes device memory in 2 MiB steps: ~2 KiB per graph of resolution
KERNELS = (1, 4, 16, 64)
KiB = 1024


def free_bytes() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def per_graph_bytes(kind: str, k: int, stream: torch.cuda.Stream) -> float:
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
    graphs = []
    before = free_bytes()
    for _ in range(GRAPHS):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=stream):
            body()
        graphs.append(g)
    after = free_bytes()
    pool_bytes = sum(s["total_size"] for s in torch.cuda.memory_snapshot(pool, include_traces=False))
    for g in graphs:
        g.replay()
    torch.cuda.synchronize()
    for g in graphs:
        g.reset()
    return (before - after - pool_bytes) / GRAPHS


def main() -> None:
    stream = torch.cuda.Stream()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, driver memory per graph, "
          f"{GRAPHS} graphs per row")
    print("| kernel | kernels per graph | KiB per graph |")
    print("|---|---|---|")
    per_graph_bytes("mm", KERNELS[-1], stream)  # the driver's one-time set-up, outside every row
    for kind in ("add", "mm"):
        rows = []
        for k in KERNELS:
            rows.append((k, per_graph_bytes(kind, k, stream)))
            print(f"| {kind} | {k} | {rows[-1][1] / KiB:.1f} |", flush=True)
        ks = [k for k, _ in rows]
        ys = [y for _, y in rows]
        mk, my = sum(ks) / len(ks), sum(ys) / len(ys)
        slope = sum((k - mk) * (y - my) for k, y in rows) / sum((k - mk) ** 2 for k in ks)
        print(f"{kind}: fitted {(my - slope * mk) / KiB:.1f} KiB per graph + {slope / KiB:.2f} KiB per kernel node")


if __name__ == "__main__":
    main()
