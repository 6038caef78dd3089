# Source: vllm-project/vllm PR #36013 ("Fix race in non-blocking num_accepted_tokens
# GPU->CPU copy"): num_accepted_tokens is copied GPU -> pinned CPU with
# non_blocking=True and read on the host in the next step's metadata build; under
# async scheduling nothing synchronizes in between.  Fix: record a CUDA event after
# the copy and synchronize() it before reading the CPU tensor.
# Plain torch: the accepted counts decide the next step's positions, i.e. the slot
# mapping (block table -> slots) that is built on the host and shipped with an async
# pinned H2D; draft KV is written with index_copy_ through that slot mapping.
#
# BUG: build_slot_mapping() reads num_accepted_cpu (.tolist()) with no event
# synchronization after the previous step's non_blocking D2H into it.
import torch

DEV = torch.device("cuda:0")
NUM_REQS, NUM_DRAFT, VOCAB = 4, 3, 64
NUM_GPU_BLOCKS, BLOCK, HEADS, DIM = 64, 16, 8, 64


def async_h2d(values):
    t = torch.tensor(values, dtype=torch.int64, pin_memory=True)
    return t.to(DEV, non_blocking=True)


class SpecDecodeRunner:
    def __init__(self):
        self.kv_slots = torch.zeros(NUM_GPU_BLOCKS * BLOCK, 2, HEADS, DIM, device=DEV,
                                    dtype=torch.float16)
        self.block_tables = [list(range(i * 8, i * 8 + 8)) for i in range(NUM_REQS)]
        self.positions = [20 + 7 * i for i in range(NUM_REQS)]
        self.num_accepted_gpu = torch.zeros(NUM_REQS, dtype=torch.int32, device=DEV)
        self.num_accepted_cpu = torch.zeros(NUM_REQS, dtype=torch.int32, pin_memory=True)
        self.accept_event = torch.cuda.Event()

    def build_slot_mapping(self, first_step):
        if not first_step:
            accepted = self.num_accepted_cpu.tolist()
            # bonus token + accepted drafts advance the position; rejected draft
            # slots are simply overwritten by this step
            self.positions = [p + a + 1 for p, a in zip(self.positions, accepted)]
        slots = []
        for table, pos in zip(self.block_tables, self.positions):
            for t in range(pos, pos + NUM_DRAFT + 1):
                slots.append(table[t // BLOCK] * BLOCK + t % BLOCK)
        return async_h2d(slots)

    def execute(self, slot_mapping):
        n = slot_mapping.numel()
        kv = torch.randn(n, 2, HEADS, DIM, device=DEV, dtype=torch.float16)
        self.kv_slots.index_copy_(0, slot_mapping, kv)  # KV of bonus + draft tokens
        h = self.kv_slots.index_select(0, slot_mapping)[:, 0].float().mean(dim=(1, 2))
        logits = h.view(NUM_REQS, NUM_DRAFT + 1, 1) * torch.randn(VOCAB, device=DEV)
        target = logits.argmax(-1)[:, :NUM_DRAFT]
        draft = torch.randint(0, 2, (NUM_REQS, NUM_DRAFT), device=DEV) * target
        accepted = (draft == target).int().cumprod(dim=1).sum(dim=1)
        self.num_accepted_gpu.copy_(accepted)
        self.num_accepted_cpu.copy_(self.num_accepted_gpu, non_blocking=True)
        return logits


def main():
    torch.manual_seed(0)
    runner = SpecDecodeRunner()
    torch.cuda.synchronize()  # setup done before any side-stream work
    outs = []
    for step in range(8):  # async scheduling: no blocking sync inside the loop
        slot_mapping = runner.build_slot_mapping(first_step=(step == 0))
        outs.append(runner.execute(slot_mapping).sum())
    torch.cuda.synchronize()
    print("positions", runner.positions, "checksum", float(torch.stack(outs).sum()))


if __name__ == "__main__":
    main()
