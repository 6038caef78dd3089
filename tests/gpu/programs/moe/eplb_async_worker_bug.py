# Source: vllm-project/vllm vllm/distributed/eplb/async_worker.py (transfer_run_periodically: a daemon
#   thread with its own experts_stream fills state.expert_buffer layer by layer, then sets
#   state.ep_buffer_ready) and PR #32881 "[BugFix] Async Eplb fix potential race condition": the main
#   thread schedules the copy buffer -> layer weights on the main stream and signals the worker, which
#   may start the next layer's transfer into the same intermediate buffer while that copy is still
#   running; fixed by recording a CUDA event after the copy and waiting on it before the transfer
#   (buffer_consumed_event). PR #37601 adds the CPU handshake that guarantees record() precedes wait().
# Bug (eplb_async_worker_bug.py): the worker thread, after the CPU handshake, writes the next layer
#   into expert_buffer on experts_stream without waiting on buffer_consumed_event, racing with the
#   main stream's (delayed) copy out of the buffer.
# Fix (eplb_async_worker_fixed.py): experts_stream.wait_event(buffer_consumed_event).
import queue
import threading

import torch

SLEEP_CYCLES = 20_000_000  # ~10 ms on the main stream (forward pass still running when the copy is queued)
LAYERS, LOCAL_EXPERTS, H, FFN = 4, 4, 256, 512
DEV = torch.device("cuda:0")


class EplbState:
    def __init__(self):
        # weights after rearrangement, as the peers would send them (stands in for isend/irecv)
        self.incoming = [torch.randn(LOCAL_EXPERTS, H, FFN, device=DEV) for _ in range(LAYERS)]
        self.expert_weights = [torch.zeros(LOCAL_EXPERTS, H, FFN, device=DEV) for _ in range(LAYERS)]
        self.expert_buffer = torch.empty(LOCAL_EXPERTS, H, FFN, device=DEV)  # one intermediate buffer
        self.buffer_lock = threading.Lock()
        self.ready_q = queue.Queue()      # worker -> main: (layer, buffer_ready_event)
        self.consumed_q = queue.Queue()   # main -> worker: buffer_consumed_event (already recorded)
        self.buffer_consumed_event = None


def transfer_run(state):
    torch.cuda.set_device(DEV)
    experts_stream = torch.cuda.Stream()
    for layer in range(LAYERS):
        if layer > 0:
            state.buffer_consumed_event = state.consumed_q.get()  # CPU handshake: copy *enqueued*
        with state.buffer_lock, torch.cuda.stream(experts_stream):
            state.expert_buffer.copy_(state.incoming[layer])   # "receive" layer into the buffer
            buffer_ready_event = experts_stream.record_event()
        state.ready_q.put((layer, buffer_ready_event))


def move_to_workspace(state, layer, buffer_ready_event):
    main_stream = torch.cuda.current_stream()
    main_stream.wait_event(buffer_ready_event)
    torch.cuda._sleep(SLEEP_CYCLES)
    with state.buffer_lock:
        state.expert_weights[layer].copy_(state.expert_buffer)
        buffer_consumed_event = main_stream.record_event()
    state.consumed_q.put(buffer_consumed_event)


def main():
    torch.manual_seed(0)
    state = EplbState()
    x = torch.randn(512, H, device=DEV)
    torch.cuda.synchronize()  # worker's stream reads `incoming`, written on the main stream above

    worker = threading.Thread(target=transfer_run, args=(state,), daemon=True)
    worker.start()
    for _ in range(LAYERS):  # main loop: one layer is committed per engine step
        layer, buffer_ready_event = state.ready_q.get()
        move_to_workspace(state, layer, buffer_ready_event)
    worker.join()

    out = torch.stack([torch.relu(x @ w).sum(dim=(1, 2)) for w in state.expert_weights])
    ref = torch.stack([torch.relu(x @ w).sum(dim=(1, 2)) for w in state.incoming])
    torch.cuda.synchronize()

    checksum = out.double().abs().sum().item()
    reference = ref.double().abs().sum().item()
    match = torch.allclose(out, ref, rtol=1e-3, atol=1e-3)
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
