"""Work captured once as a CUDA graph and replayed: one launch where Python would issue many small kernels.

On a GPU, a step of a small model (the engine's decode steps and prefills, rlsys/engine/decode_graphs.py) or a pass
over many small tensors (the weight checksum, rlsys/weight_checksum.py) is bound by the host issuing its kernels,
not by the kernels. A graph replays exactly the kernels it recorded, on the addresses it recorded: what a replay
varies must live in device buffers filled before it.

`GRAPH_CAPTURE` holds a capture per device type; on other devices the work runs eagerly (tests register a stand-in
whose replay calls the function again).
"""

from collections.abc import Callable

import torch


class CudaGraphCapture:
    """Captures a function as a CUDA graph; replaying it returns the function's output tensor, rewritten in place.
    Every graph shares one memory pool: they replay one at a time and their outputs are read before the next."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # One eager run on a side stream first, as torch asks: cuBLAS creates its handles and workspaces there,
        # outside the capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the weight receiver's thread may touch the GPU while this thread captures.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


GRAPH_CAPTURE: dict[str, Callable[[], Callable]] = {"cuda": CudaGraphCapture}  # by device type
