"""Three Adam steps over the guide MLP's parameters as a training step launches them:
FP32 masters, FP16 copies of the weights, the flag read, no loss scale (unscaled before)."""

import torch

from mpgemm.scaling import adam_step_

shapes = [(4096, 784), (4096,), (4096, 4096), (4096,), (10, 4096), (10,)]
params = [torch.randn(s, device="cuda") for s in shapes]
grads = [torch.randn_like(p) * 1e-3 for p in params]
m = [torch.zeros_like(p) for p in params]
v = [torch.zeros_like(p) for p in params]
steps = [torch.zeros((), device="cuda") for _ in params]
copies = [p.half() if p.dim() == 2 else p for p in params]
found = torch.zeros((), device="cuda")
for _ in range(3):
    adam_step_(
        params,
        grads,
        m,
        v,
        steps,
        compute_copies=copies,
        found_inf=found,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        decoupled_weight_decay=False,
        maximize=False,
    )
torch.cuda.synchronize()
print("ok")
