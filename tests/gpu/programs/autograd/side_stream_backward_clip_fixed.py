# Source: PyTorch CUDA semantics note "Stream semantics of backward passes" (docs/source/notes/cuda.rst)
#         and pytorch/pytorch PR #60421 (backward() no longer syncs the default stream with the leaf
#         streams); discuss.pytorch.org/t/cuda-streams-gradient-manipulation/144224 (modules run forward
#         and backward on their own streams, gradients are clipped afterwards).
# Pattern: an actor/critic pair is trained concurrently; the critic runs forward+backward inside a
# side-stream context, so its backward kernels (and AccumulateGrad) run on critic_stream. The joint
# gradient clipping then runs on the default stream.
import copy

import torch
import torch.nn as nn

SLEEP = 20_000_000
dev = torch.device("cuda")
torch.manual_seed(0)


def make_net():
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512)).to(dev)


class ActorCriticTrainer:
    def __init__(self, actor, critic, max_norm):
        self.actor = actor
        self.critic = critic
        self.max_norm = max_norm
        self.critic_stream = torch.cuda.Stream()

    def params(self):
        return list(self.actor.parameters()) + list(self.critic.parameters())

    def step(self, xa, xc):
        main = torch.cuda.current_stream()
        self.critic_stream.wait_stream(main)  # weights and xc were produced on the default stream
        with torch.cuda.stream(self.critic_stream):
            torch.cuda._sleep(SLEEP)  # the critic branch is the slow one
            loss_c = self.critic(xc).pow(2).mean()
            loss_c.backward()  # critic grads are produced on critic_stream
        loss_a = self.actor(xa).pow(2).mean()
        loss_a.backward()  # actor grads are produced on the default stream
        # FIX: the clip reads/writes critic grads on the default stream; order it after critic_stream.
        main.wait_stream(self.critic_stream)
        return nn.utils.clip_grad_norm_(self.params(), self.max_norm)


def grad_checksum(params):
    return torch.stack([p.grad.double().abs().sum() for p in params]).sum().item()


actor, critic = make_net(), make_net()
ref_actor, ref_critic = copy.deepcopy(actor), copy.deepcopy(critic)
xa = torch.randn(4096, 512, device=dev)
xc = torch.randn(4096, 512, device=dev)

trainer = ActorCriticTrainer(actor, critic, max_norm=0.5)
norm = trainer.step(xa, xc)
torch.cuda.synchronize()
checksum = grad_checksum(trainer.params()) + norm.item()

# Reference: the same step with everything on the default stream.
ref_actor(xa).pow(2).mean().backward()
ref_critic(xc).pow(2).mean().backward()
ref_params = list(ref_actor.parameters()) + list(ref_critic.parameters())
ref_norm = nn.utils.clip_grad_norm_(ref_params, 0.5)
reference = grad_checksum(ref_params) + ref_norm.item()

torch.cuda.synchronize()
match = abs(checksum - reference) <= 1e-4 * abs(reference) + 1e-6
print(f"checksum={checksum:.6f} reference={reference:.6f} match={match}")
