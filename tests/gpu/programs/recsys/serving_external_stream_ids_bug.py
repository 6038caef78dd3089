# Source: plausible pattern (recsys inference server that owns one CUDA stream per worker and hands its raw
#   handle to the Python lookup handler, wrapped with torch.cuda.ExternalStream); the missing
#   record_stream follows meta-pytorch/torchrec PR #2598 "Fix semi-sync race conditions and optimize
#   memory usage" (tensors allocated in one stream and used in another need record_stream) and
#   torchrec's PipelinedForward (data.record_stream(cur_stream)).
"""Request handler: the request's ids are uploaded on the caller's stream, the embedding lookup runs on the
worker's external stream, and the pooled embeddings are returned to the caller."""
import torch

SLEEP_CYCLES = 20_000_000
DEV = torch.device("cuda", 0)
NUM_ROWS, DIM, N_IDS, BAG, NUM_REQUESTS = 100_000, 64, 8192, 16, 6


class EmbeddingLookupHandler:
    def __init__(self, table, worker_stream_handle):
        self.table = table
        self.worker_stream = torch.cuda.ExternalStream(worker_stream_handle, device=DEV)

    def handle(self, ids_host):
        caller = torch.cuda.current_stream()
        ids = ids_host.to(DEV, non_blocking=True)  # allocated and written on the caller's stream
        self.worker_stream.wait_stream(caller)
        with torch.cuda.stream(self.worker_stream):
            # the worker stream is still running the previous request's dense towers
            torch.cuda._sleep(SLEEP_CYCLES)
            pooled = self.table.index_select(0, ids).view(-1, BAG, DIM).sum(1)
        return pooled


def main():
    torch.manual_seed(0)
    table_cpu = torch.randn(NUM_ROWS, DIM)
    table = table_cpu.to(DEV)
    requests = [torch.randint(0, NUM_ROWS, (N_IDS,)).pin_memory() for _ in range(NUM_REQUESTS)]
    server_stream = torch.cuda.Stream()  # owned by the serving runtime; kept alive for the whole run
    handler = EmbeddingLookupHandler(table, server_stream.cuda_stream)
    torch.cuda.synchronize()

    results = [handler.handle(ids_host) for ids_host in requests]
    torch.cuda.current_stream().wait_stream(handler.worker_stream)
    got = torch.stack(results).cpu()
    torch.cuda.synchronize()

    ref = torch.stack([table_cpu[r].view(-1, BAG, DIM).sum(1) for r in requests])
    match = torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
    checksum, ref_checksum = got.abs().sum().item(), ref.abs().sum().item()
    torch.cuda.synchronize()
    print(f"checksum={checksum:.4f} reference={ref_checksum:.4f} match={match}")


if __name__ == "__main__":
    main()
