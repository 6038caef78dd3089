# Source: NVIDIA/TensorRT-LLM
#   tensorrt_llm/_torch/auto_deploy/transform/library/multi_stream_moe.py
#   torch.library custom ops auto_deploy::record_event / auto_deploy::wait_event
#   and *_moe_fused_aux ops: the routed experts run on an aux stream after
#   wait_event(MAIN); the op records the AUX event and then calls
#   wait_event(AUX) on the main stream before returning its output, while the
#   shared expert runs concurrently on the main (default) stream.
# Pattern: stream switching hidden inside torch.library custom ops; the output
# of the aux-stream op is consumed by the residual add on the main stream.
import torch
import torch.nn.functional as F

SLEEP_CYCLES = 20_000_000  # ~10 ms of GPU time
HIDDEN = 1024
FFN = 2048
TOKENS = 1024
LAYERS = 4
MAIN, AUX = "main", "aux"


class CudaStreamManager:
    def __init__(self):
        self.streams = {MAIN: torch.cuda.current_stream(), AUX: torch.cuda.Stream()}
        self.events = {MAIN: torch.cuda.Event(), AUX: torch.cuda.Event()}


stream_mgr = CudaStreamManager()


@torch.library.custom_op("storage_demo::record_event", mutates_args=())
def record_event(stream_name: str) -> None:
    stream_mgr.events[stream_name].record()


@torch.library.custom_op("storage_demo::wait_event", mutates_args=())
def wait_event(stream_name: str) -> None:
    stream_mgr.events[stream_name].wait()


@torch.library.custom_op("storage_demo::routed_experts_aux", mutates_args=())
def routed_experts_aux(x: torch.Tensor, gate: torch.Tensor, w_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
    with torch.cuda.stream(stream_mgr.streams[AUX]):
        torch.ops.storage_demo.wait_event(MAIN)
        torch.cuda._sleep(SLEEP_CYCLES)            # aux stream still busy (dispatch / a2a)
        output = (F.silu(x @ w_up) @ w_down) * gate
        torch.ops.storage_demo.record_event(AUX)
    # FIX: the main stream must wait for the aux stream before it consumes `output`
    torch.ops.storage_demo.wait_event(AUX)
    return output


@routed_experts_aux.register_fake
def _(x, gate, w_up, w_down):
    return torch.empty_like(x)


def routed_experts_ref(x, gate, w_up, w_down):
    return (F.silu(x @ w_up) @ w_down) * gate


def moe_layer(x, p, routed_fn, keep_alive):
    gate = torch.sigmoid(x @ p["w_gate"])                 # routing on the main stream
    keep_alive.append(gate)
    if routed_fn is None:
        torch.ops.storage_demo.record_event(MAIN)         # routing results ready
        routed = torch.ops.storage_demo.routed_experts_aux(x, gate, p["w_up"], p["w_down"])
    else:
        routed = routed_fn(x, gate, p["w_up"], p["w_down"])
    shared = F.silu(x @ p["s_up"]) @ p["s_down"]          # shared expert overlaps on main
    return x + shared + routed


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)

    def w(*shape):
        return torch.randn(*shape, device=dev) / shape[0] ** 0.5

    params = [dict(w_gate=w(HIDDEN, 1), w_up=w(HIDDEN, FFN), w_down=w(FFN, HIDDEN),
                   s_up=w(HIDDEN, FFN), s_down=w(FFN, HIDDEN)) for _ in range(LAYERS)]
    x0 = torch.randn(TOKENS, HIDDEN, device=dev)

    with torch.inference_mode():
        keep = []
        ref = x0
        for p in params:
            ref = moe_layer(ref, p, routed_experts_ref, keep)
        reference = ref.double().sum().item()
        torch.cuda.synchronize()

        hidden_states = [x0]                              # like output_hidden_states=True
        x = x0
        for p in params:
            x = moe_layer(x, p, None, hidden_states)
            hidden_states.append(x)
        checksum = x.double().sum().item()
    torch.cuda.synchronize()
    match = abs(checksum - reference) <= 1e-3 * max(1.0, abs(reference))
    print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")


if __name__ == "__main__":
    main()
