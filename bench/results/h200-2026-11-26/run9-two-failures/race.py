import sys
import time

import torch

sys.path.insert(0, ".")
if sys.argv[1] == "load":
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.half)
    t = time.time()
    while time.time() - t < float(sys.argv[2]):
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    sys.exit()
import mpgemm
from tests.test_fused_optim import OPTIMIZERS, _mlp

for name in ("sgd", "adam"):
    ours_make, torch_make = OPTIMIZERS[name]
    worst = 0.0
    for rep in range(int(sys.argv[2])):
        runs = []
        for make, sc in ((ours_make, mpgemm.GradScaler), (torch_make, torch.amp.GradScaler)):
            model = _mlp("cpu")
            model[0].cuda()
            opt, scaler = make(model.parameters()), sc("cuda", init_scale=2.0**8)
            g = torch.Generator().manual_seed(1)
            for _i in range(3):
                x, y = torch.randn(32, 12, generator=g), torch.randn(32, 3, generator=g)
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(model[1:](model[0](x.cuda()).cpu()), y)
                scaler.scale(loss.cuda()).backward()
                scaler.step(opt)
                scaler.update()
            runs.append([p.detach().cpu().clone() for p in model.parameters()])
        d = [float((p - q).abs().max()) for p, q in zip(*runs, strict=False)]
        worst = max(worst, max(d))
        if max(d) > 1e-6:
            print(name, rep, d)
    print(name, "worst", worst)
